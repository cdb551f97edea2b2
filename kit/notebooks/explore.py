"""The probe explorer of notebook 05: a probe's knobs as widgets, a Run button, a progress bar and the redrawn figure
(``ProbeExplorer``; headless, e.g. under papermill, ``run()`` draws straight into the cell), and the checks of the
notebook's parameters. The record browsers of notebooks 01-04 are ``gradkit.notebooks.browse``."""
from __future__ import annotations

import contextlib
import threading

from gradkit import config as kconfig
from gradkit import launch, probes
from gradkit.judge import tables
from gradkit.probes import pipeline_ga, runner

KNOB_LABELS = {"world_size": "world size W", "ga": "GA / N", "zero_stage": "ZeRO stage", "dtype": "dtype",
               "version": "version"}


def knobs() -> dict:
    """What each probe lets a user choose (``Probe.knobs``); the first value of each list is the default."""
    return {p.id: p.knobs for p in probes.registry().values()}


def _check_bug(bug) -> None:
    probes.get(bug)


def default_selection(bug: str = "B3") -> dict:
    _check_bug(bug)
    return {"bug": bug, **{k: v[0] for k, v in knobs()[bug].items()}}


def probe_call(sel: dict, device: str = "cpu", timeout_s: float = 600) -> tuple[str, dict]:
    """The probe's id and the keyword arguments of its ``run`` for one selection (``Probe.explorer_kwargs``).

    Pure and fast: every knob is checked here (``ConfigError``), so a bad selection never launches ranks.
    """
    bug = sel.get("bug")
    probe = probes.get(bug)
    for knob, allowed in probe.knobs.items():
        if sel.get(knob) not in allowed:
            raise kconfig.ConfigError(f"{bug}: {KNOB_LABELS[knob]} {sel.get(knob)!r} is not one of {allowed}")
    kconfig.check_world_size(sel["world_size"], device)
    return probe.id, probe.explorer_kwargs(sel, device, timeout_s)


def check_notebook(p: dict) -> list:
    """Every parameter of notebook 05, by its name there (what the notebook and ``gradkit.notebooks.runall`` call
    first); returns the ``(probe, stack)`` pairs its worlds will run (``gradkit.stacks.prefetch``)."""
    kconfig.check_timeout(p["TIMEOUT_S"])
    bug, kwargs = probe_call({"bug": p["BUG"], "world_size": p["WORLD_SIZE"], "ga": p["GA"], "zero_stage": p["ZERO_STAGE"],
                "dtype": p["DTYPE"], "version": p["VERSION"]}, p["DEVICE"], p["TIMEOUT_S"])
    return [(probes.get(bug), stack) for stack in runner.stacks_in(kwargs)]


def run_probe(probe_id: str, kwargs: dict) -> list[dict]:
    """Launch the probe's worlds (the default runner of the explorer)."""
    return probes.get(probe_id).run(**kwargs)


def result_rows(recs: list[dict], sel: dict) -> list[dict]:
    """What the explorer's figure shows: one row per judged case (per pipeline stage for B2) at the chosen GA."""
    bug = probes.get(sel["bug"])
    rows = []
    for r in recs:
        if r.get("role") == "symptom" or (r["ga"] != sel["ga"] and r["role"] != "control"):
            continue
        verdict = (r.get(bug.verdict_key) or r["verdict"]) if r["case"] == bug.measured_case else r["verdict"]
        parts = [(f" · stage {s['stage'] if 'stage' in s else i}", s.get("metrics") or {}, s.get("verdict", verdict),
                  pipeline_ga.stage_steps(r, s.get("stage", i))) for i, s in enumerate(r["stages"])] if r.get("stages") else \
            [("", r.get("metrics") or {}, verdict, tables.per_step(r) if r.get("metrics") else "-")]
        for suffix, m, v, steps in parts:
            rows.append({"label": f"{r['case']} ({r['role']}, GA {r['ga']}){suffix}", "case": r["case"],
                         "role": r["role"], "ratio": m.get("norm_ratio"), "cosine": m.get("cosine"), "verdict": v,
                         "per_step": steps, "reason": r.get("reason", "")})
    return rows


def sentence(rows: list[dict], sel: dict) -> str:
    """The result in words, with its numbers."""
    measured = [r for r in rows if r["case"] == probes.get(sel["bug"]).measured_case]
    if not measured:
        return "no measured case came back"
    worst = max(measured, key=lambda r: abs((r["ratio"] or 1) - 1))
    if worst["ratio"] is None:
        return f"{sel['bug']} could not be measured here: {worst['reason'][:200]}"
    return (f"{sel['bug']} at W={sel['world_size']}, GA/N={sel['ga']}, ZeRO {sel['zero_stage']}, {sel['dtype']}, "
            f"{sel['version']}: **{worst['verdict']}**: the applied gradient is {worst['ratio']:.3f} x the "
            f"reference (cosine {worst['cosine']:.3f}) for {worst['label']}; per optimizer step (* off): "
            f"{worst.get('per_step', '-')}.")


class ProbeExplorer:
    """Sliders and dropdowns for one probe run, a Run button, a progress bar, and the redrawn figure.

    ``runner(probe_id, kwargs) -> records`` launches the probe (default ``run_probe``); tests pass a fake.
    Headless (``interactive=False``, e.g. under papermill) ``run()`` draws the figure straight into the
    cell's output; in JupyterLab the figure goes into the widget's output area.

    Stopping a run. Run starts it in a thread of its own (``start``), so that while it runs the kernel still
    hears **Stop** and the kernel's **Interrupt**: JupyterLab 4.6 hands widget clicks to a kernel subshell (a
    thread) that SIGINT never reaches, and ipykernel ignores SIGINT between cells, so for the length of a run a
    SIGINT handler of the explorer's own is armed on the kernel's main thread (through its event loop). Either
    way the run's world is stopped (its ranks killed) and the status line says so. ``run()`` called from a cell
    blocks as before, and the cell's Interrupt raises ``KeyboardInterrupt`` in it as usual.
    """

    def __init__(self, selection: dict | None = None, device: str = "cpu", timeout_s: float = 600,
                 runner=None, interactive: bool = True):
        import ipywidgets as widgets

        self.device, self.timeout_s, self.interactive = device, timeout_s, interactive
        self.runner = runner or run_probe
        self.records: list[dict] = []
        self.rows: list[dict] = []
        sel = selection or default_selection()
        wide = {"description_width": "initial"}  # labels in full ("world size W"), never cut to "world size…"
        self.bug = widgets.Dropdown(options=list(knobs()), value=sel["bug"], description="bug", style=wide)
        self.knobs = {
            "world_size": widgets.SelectionSlider(options=[1], description=KNOB_LABELS["world_size"], style=wide),
            "ga": widgets.SelectionSlider(options=[1], description=KNOB_LABELS["ga"], style=wide),
            "zero_stage": widgets.Dropdown(options=[0], description=KNOB_LABELS["zero_stage"], style=wide),
            "dtype": widgets.Dropdown(options=["fp32"], description=KNOB_LABELS["dtype"], style=wide),
            "version": widgets.Dropdown(options=["installed"], description=KNOB_LABELS["version"], style=wide),
        }
        self.button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="warning", icon="stop", disabled=True)
        self.progress = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, description="ranks", style=wide)
        self.status = widgets.HTML(value="choose a configuration and press Run")
        self.output = widgets.Output()
        self._set_options(sel)
        self.bug.observe(lambda change: self._set_options(default_selection(change["new"])), names="value")
        for w in (self.bug, *self.knobs.values()):  # what Run will run, said as soon as the kernel has it
            w.observe(lambda change: self._say_selected(), names="value")
        self.button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.cancel.set())
        self.cancel = threading.Event()  # Stop, or a SIGINT while a started run is in flight
        self.thread: threading.Thread | None = None
        self._main_loop = _main_thread_loop()

    def _set_options(self, sel: dict) -> None:
        for knob, w in self.knobs.items():
            opts = sorted(knobs()[sel["bug"]][knob], key=str)
            w.options = opts
            w.value = sel[knob] if sel[knob] in opts else opts[0]

    def _say_selected(self) -> None:
        if not self.button.disabled:  # a run in flight keeps its own status line
            self.status.value = (f"selected {_title(self.selection())}: press Run"
                                 + (" (the figure below is the last run's)" if self.output.outputs else ""))

    def selection(self) -> dict:
        return {"bug": self.bug.value, **{k: w.value for k, w in self.knobs.items()}}

    def widget(self):
        import ipywidgets as widgets

        threading.Thread(target=self.prewarm, daemon=True, name="gradkit-explorer-prewarm").start()
        return widgets.VBox([widgets.HBox([self.bug, self.knobs["version"]]),
                             widgets.HBox([self.knobs["world_size"], self.knobs["ga"]]),
                             widgets.HBox([self.knobs["zero_stage"], self.knobs["dtype"]]),
                             widgets.HBox([self.button, self.stop_button, self.progress]), self.status, self.output])

    def prewarm(self) -> bool:
        """Start the warm world the current selection will run in (``gradkit.launch.prewarm``), so that even the first
        Run finds its ranks up and their imports paid; False (and nothing said) when it cannot: Run will say why."""
        sel = self.selection()
        try:
            bug, kwargs = probe_call(sel, self.device, self.timeout_s)
            probe, stack = probes.get(bug), runner.stacks_in(kwargs)[0]
            world, _ = runner.world_for(probe, stack, sel["world_size"], self.device, self.timeout_s)
            launch.prewarm(world, probe.target)
            return True
        except Exception:  # noqa: BLE001 - an optimisation only
            return False

    def start(self) -> threading.Thread | None:
        """The Run button: ``run()`` in a thread of its own, with Stop and the kernel's Interrupt armed. A click
        while a run is in flight (its button disabled) is not one; a click once the button is back, while the last
        run still draws its figure, waits for that and then runs."""
        if self.thread is not None and self.thread.is_alive():
            if self.button.disabled:
                return None
            self.thread.join()
        self.cancel.clear()
        disarm = _on_sigint(self._main_loop, self.cancel.set)
        self.thread = threading.Thread(target=self._run_then, args=(disarm,), daemon=True, name="gradkit-explorer-run")
        self.thread.start()
        return self.thread

    def _run_then(self, disarm) -> None:
        try:
            self.run()
        finally:
            disarm()

    def run(self) -> list[dict]:
        """One run, blocking: check the selection, launch the probe in a thread while the progress bar moves, redraw."""
        import time

        sel = self.selection()
        try:
            probe_id, kwargs = probe_call(sel, self.device, self.timeout_s)
        except kconfig.ConfigError as e:
            self.status.value = f"<b>cannot run this selection:</b> {e}"
            self.progress.value = 0.0
            return []
        result: dict = {}
        heard: dict = {"done": 0, "planned": 0, "worlds": 0, "first_time": ""}  # from the ranks (gradkit.probes.runner.listen)

        def hear(event):
            if event["kind"] == "world":
                heard.update(worlds=heard["worlds"] + 1, first_time=event["first_time"],
                             base=heard["done"], planned=heard["done"] + event["planned"])
            else:
                heard["done"] = heard.get("base", 0) + event["done"]

        def work():
            warm = launch.warm_worlds() if self.interactive else contextlib.nullcontext()
            try:
                with runner.listen(hear), warm:  # in JupyterLab the ranks stay up between Runs
                    result["records"] = self.runner(probe_id, kwargs)
            except Exception as e:  # noqa: BLE001 - shown in the status line, never swallowed silently
                result["error"] = e

        self.button.disabled, self.stop_button.disabled = True, False
        self.progress.bar_style = ""
        self.progress.value = 0.0
        if self.output.outputs:  # never leave the previous selection's figure under a new run
            self._say_in_output(f"running {_title(sel)}: the previous figure is cleared; the new one is drawn here "
                                "when the ranks are done")
        t0 = time.monotonic()
        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                if self.cancel.is_set():  # Stop, or the kernel's Interrupt during a started run
                    raise KeyboardInterrupt
                elapsed = time.monotonic() - t0
                if heard["planned"]:  # what the ranks reported: cases done of cases planned (5 %: ranks starting)
                    self.progress.value = min(0.99, 0.05 + 0.95 * heard["done"] / heard["planned"])
                    step = (f"{heard['done']} of {heard['planned']} cases done"
                            + (f" (world {heard['worlds']})" if heard["worlds"] > 1 else ""))
                    if heard["done"] == heard.get("base", 0):
                        step += (f"; first launch: {heard['first_time']}" if heard["first_time"]
                                 else "; the ranks are starting (importing torch and DeepSpeed)")
                else:
                    step = "preparing the world"
                self.status.value = f"ranks running: {sel['bug']}: {step}, {elapsed:.0f} s"
                thread.join(0.1)
        except KeyboardInterrupt:  # the kernel's interrupt: stop the world, not just this loop

            stopped = launch.stop_worlds()
            thread.join(10)
            self.button.disabled, self.stop_button.disabled = False, True
            self.progress.bar_style = "danger"
            self.status.value = (f"<b>interrupted</b> after {time.monotonic() - t0:.0f} s: {stopped} world(s) stopped, "
                                 "their ranks killed; nothing was measured")
            self._say_in_output(f"no figure: the run of {_title(sel)} was interrupted")
            return []
        self.button.disabled, self.stop_button.disabled = False, True
        self.progress.value = 1.0
        if "error" in result:
            self.progress.bar_style = "danger"
            self.status.value = f"<b>the probe failed:</b> {type(result['error']).__name__}: {result['error']}"
            self._say_in_output(f"no figure: the run of {_title(sel)} failed")
            return []
        self.records = result["records"]
        self.rows = result_rows(self.records, sel)
        self.progress.bar_style = "success"
        self.status.value = markdown_bold(sentence(self.rows, sel)) + f" ({time.monotonic() - t0:.0f} s)"
        self.redraw(sel)
        return self.records

    def _say_in_output(self, text: str) -> None:
        """Replace what the figure area shows with one italic line (only where a figure was or is awaited)."""
        if not self.interactive or not self.output.outputs:
            return
        import html

        from IPython.display import HTML

        self.output.outputs = ()
        self.output.append_display_data(HTML(f"<i>{html.escape(text)}</i>"))

    def redraw(self, sel: dict | None = None) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import display

        from gradkit.notebooks import probe_plots

        sel = sel or self.selection()
        fig = probe_plots.explorer_result(self.rows, title=_title(sel))
        if self.interactive:  # a PNG appended to the output area: works from a kernel thread and from a test
            import io

            from IPython.display import Image

            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
            self.output.outputs = ()
            self.output.append_display_data(Image(data=buf.getvalue(), format="png"))
        else:
            display(fig)
        plt.close(fig)


def _main_thread_loop():
    """The kernel's main-thread event loop, when called from a cell (where ipykernel runs one); else None."""
    import asyncio

    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _on_sigint(loop, callback):
    """Until the returned ``disarm()`` is called, a SIGINT to this process calls ``callback`` (installed on the main
    thread through ``loop``: only that thread may set a signal handler); nothing when there is no such loop."""
    import signal

    if loop is None or loop.is_closed():
        return lambda: None
    state: dict = {}

    def handler(_signum, _frame):
        callback()

    def arm():
        state["before"] = signal.signal(signal.SIGINT, handler)

    def disarm_now():
        if "before" in state and signal.getsignal(signal.SIGINT) is handler:
            signal.signal(signal.SIGINT, state["before"])

    loop.call_soon_threadsafe(arm)
    return lambda: loop.is_closed() or loop.call_soon_threadsafe(disarm_now)


def markdown_bold(text: str) -> str:
    """The status line is HTML: the sentence's **bold** (its verdict) stays bold instead of being dropped."""
    import html
    import re

    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))


def _title(sel: dict) -> str:
    return (f"{sel['bug']}: W={sel['world_size']}, GA/N={sel['ga']}, ZeRO {sel['zero_stage']}, {sel['dtype']}, "
            f"{sel['version']}")
