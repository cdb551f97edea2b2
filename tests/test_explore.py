"""The explorer's callback logic, driven without a browser: widgets are set and the Run button clicked in Python."""
import matplotlib
import pytest

from gradkit import config
from gradkit.notebooks import explore

matplotlib.use("Agg")


def _fake_records(module, kwargs, ratio=0.4026, cosine=0.6225):
    """What a B3 probe world returns, reduced to the keys the explorer reads."""
    ga = kwargs["fix_n_values"][0]
    rec = lambda case, role, g, r, c, v: {"bug": "B3", "case": case, "role": role, "ga": g, "dtype": "fp32",  # noqa: E731
                                         "world_size": kwargs["world_sizes"][0], "verdict": v, "reason": "",
                                         "metrics": {"norm_ratio": r, "cosine": c}}
    return [rec("control", "control", ga, 1.0, 1.0, "not-affected"),
            rec("manual", "measured", 1, 1.0, 1.0, "not-affected"),
            rec("manual", "measured", ga, ratio, cosine, "affected"),
            rec("fix_boundary", "fix", ga, 1.0, 1.0, "not-affected")]


class Recorder:
    def __init__(self, result=_fake_records):
        self.calls, self.result = [], result

    def __call__(self, module, kwargs):
        self.calls.append((module, kwargs))
        return self.result(module, kwargs)


def click(ex):
    """Run, as a user clicks it (the run goes on in its own thread), then wait for it to end."""
    ex.button.click()
    ex.thread.join(30)
    assert not ex.thread.is_alive()


def test_run_button_launches_the_chosen_probe_and_redraws():
    runner = Recorder()
    ex = explore.ProbeExplorer(runner=runner, interactive=True)
    ex.bug.value = "B3"
    ex.knobs["ga"].value = 8
    ex.knobs["zero_stage"].value = 1
    click(ex)
    (module, kwargs), = runner.calls
    assert module == "B3"
    assert kwargs["n_values"] == [1, 8] and kwargs["stages"] == [1] and kwargs["fix_n_values"] == [8]
    assert kwargs["world_sizes"] == [2] and kwargs["versions"] == ["installed"]
    assert ex.progress.value == 1.0 and ex.progress.bar_style == "success"
    assert "affected" in ex.status.value and "0.403" in ex.status.value
    assert [r["case"] for r in ex.rows] == ["control", "manual", "fix_boundary"]  # GA 1 measured row left out
    assert len(ex.output.outputs) == 1  # the figure, redrawn into the output area
    click(ex)
    assert len(runner.calls) == 2 and len(ex.output.outputs) == 1  # replaced, not appended


def test_choosing_a_bug_offers_only_its_knobs():
    ex = explore.ProbeExplorer(runner=Recorder(), interactive=False)
    ex.bug.value = "B4"
    assert ex.knobs["dtype"].options == ("bf16",) and ex.knobs["zero_stage"].options == (1,)
    assert explore.probe_call(ex.selection())[0] == "B4"
    ex.bug.value = "B2"
    assert set(ex.knobs["world_size"].options) == {2, 4}
    module, kwargs = explore.probe_call(ex.selection())
    assert module == "B2" and kwargs["splits"] == [[2, 4]]
    ex.bug.value = "B1"
    ex.knobs["zero_stage"].value = "none"
    module, kwargs = explore.probe_call(ex.selection())
    assert module == "B1" and kwargs["paths"] == ["no_ds"] and kwargs["gas_values"] == [1, 4]


def test_a_bad_selection_never_launches():
    runner = Recorder()
    ex = explore.ProbeExplorer(runner=runner, interactive=False)
    sel = {**ex.selection(), "world_size": 999}
    with pytest.raises(config.ConfigError):
        explore.probe_call(sel)
    ex.knobs["world_size"].options = [2, 999]  # what a hand-edited widget could hold
    ex.knobs["world_size"].value = 999
    assert ex.run() == [] and runner.calls == []
    assert "cannot run this selection" in ex.status.value
    with pytest.raises(config.ConfigError, match="unknown probe"):
        explore.default_selection("B9")


def test_a_failing_probe_is_reported_not_swallowed():
    def boom(module, kwargs):
        raise RuntimeError("rank 1 raised ValueError")
    ex = explore.ProbeExplorer(runner=boom, interactive=False)
    assert ex.run() == []
    assert ex.progress.bar_style == "danger" and "rank 1 raised ValueError" in ex.status.value
    assert not ex.button.disabled


@pytest.mark.world
def test_a_front_end_click_in_a_real_kernel_moves_the_progress_bar_then_reports(repo):
    """What a browser does: a comm 'click' message to the Run button's model, then widget updates back on iopub."""
    import time

    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="gradkit", cwd=str(repo))
    try:
        setup = kc.execute("import matplotlib; matplotlib.use('Agg')\nfrom gradkit.notebooks import explore\n"
                           "ex = explore.ProbeExplorer(explore.default_selection('B4'), interactive=True)\n"
                           "print(ex.button.model_id, ex.progress.model_id, ex.status.model_id)")
        ids = None
        while True:
            m = kc.get_iopub_msg(timeout=120)
            if m["msg_type"] == "stream":
                ids = m["content"]["text"].split()
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" \
                    and m["parent_header"].get("msg_id") == setup:
                break
        button, progress, status = ids
        click = kc.session.msg("comm_msg", {"comm_id": button, "data": {"method": "custom", "content": {"event": "click"}}})
        kc.session.send(kc.shell_channel.socket, click)
        values, said, final, t0 = [], [], None, time.time()
        while time.time() - t0 < 300 and not (values and values[-1] == 1.0 and final):
            try:
                m = kc.get_iopub_msg(timeout=5)
            except Exception:  # noqa: BLE001 - queue.Empty: nothing new yet
                continue
            if m["msg_type"] == "comm_msg":
                state = m["content"]["data"].get("state", {})
                if m["content"]["comm_id"] == progress and "value" in state:
                    values.append(state["value"])
                if m["content"]["comm_id"] == status and "value" in state:
                    said.append(state["value"])
                    if "(measured" in state["value"]:
                        final = state["value"]
        assert values[-1] == 1.0 and any(0 < v < 1 for v in values), values  # it moved while the ranks ran
        # the progress comes from the ranks: the cases the world plans, then those it finished
        assert any("0 of 3 cases done" in s for s in said), said[:5]
        assert final and "B4" in final and "not-affected" in final and "1.000 x the reference" in final
    finally:
        km.shutdown_kernel(now=True)


def test_a_new_run_never_shows_the_previous_selections_figure():
    seen = []

    def runner(module, kwargs):
        seen.append([next(iter(o["data"])) for o in ex.output.outputs])  # what the output area holds meanwhile
        seen[-1].append(" ".join(o["data"].get("text/html", "") for o in ex.output.outputs))
        return _fake_records(module, kwargs)

    ex = explore.ProbeExplorer(runner=runner, interactive=True)
    ex.bug.value = "B3"
    click(ex)
    assert [next(iter(o["data"])) for o in ex.output.outputs] == ["image/png"]  # the first figure
    ex.knobs["ga"].value = 8
    click(ex)
    during = seen[-1]
    assert "image/png" not in during[:-1] and "running B3: W=2, GA/N=8" in during[-1] and "cleared" in during[-1]
    assert [next(iter(o["data"])) for o in ex.output.outputs] == ["image/png"]  # the new figure replaced the note


def test_labels_are_whole_and_the_verdict_stays_bold():
    ex = explore.ProbeExplorer(runner=Recorder(), interactive=False)
    widgets = [ex.bug, ex.progress, *ex.knobs.values()]
    assert all(w.style.description_width == "initial" for w in widgets)  # "world size W", not "world size…"
    ex.run()
    assert "<b>affected</b>" in ex.status.value and "**" not in ex.status.value
    assert explore.markdown_bold("a <b> & **x**") == "a &lt;b&gt; &amp; <b>x</b>"


def test_stop_ends_a_started_run_and_says_so():
    """Run returns at once (the kernel stays free to hear Stop); Stop ends the run within a poll, the status and
    the figure area say it was interrupted, and Run is offered again."""
    import threading
    import time

    release, slow = threading.Event(), []

    def runner(module, kwargs):
        if slow:
            release.wait(30)  # a world that would run for a while
        return _fake_records(module, kwargs)

    ex = explore.ProbeExplorer(runner=runner, interactive=True)
    click(ex)  # a first, finished run: its figure is in the output area
    slow.append(True)
    ex.button.click()
    assert ex.thread.is_alive() and ex.button.disabled and not ex.stop_button.disabled
    ex.stop_button.click()
    time.sleep(0.5)
    release.set()  # the world ends as its killed ranks do
    ex.thread.join(60)  # a hang guard: the thread ends as soon as its world does
    assert not ex.thread.is_alive()
    assert "<b>interrupted</b>" in ex.status.value and ex.progress.bar_style == "danger"
    assert not ex.button.disabled and ex.stop_button.disabled
    assert "no figure: the run of B3" in ex.output.outputs[0]["data"]["text/html"]


def test_a_click_while_the_last_run_still_draws_its_figure_runs_after_it_and_one_during_a_run_does_not():
    """The Run button comes back before the figure is drawn: a click then (a user, or a browser test, quick after
    the figure shows) is a Run, started once the last run has drawn; a click while a run is in flight is none."""
    import threading

    drawing, release = threading.Event(), threading.Event()
    runner = Recorder()
    ex = explore.ProbeExplorer(runner=runner, interactive=True)
    real = ex.redraw

    def slow_redraw(sel=None):
        drawing.set()
        release.wait(30)  # the figure of the first run is still being drawn
        real(sel)

    ex.redraw = slow_redraw
    ex.button.click()
    assert drawing.wait(30) and not ex.button.disabled  # the button is back, the first run's thread still draws
    first = ex.thread
    clicked = threading.Thread(target=ex.button.click)  # the kernel hears the click while the figure is drawn
    clicked.start()
    clicked.join(0.5)
    assert clicked.is_alive() and len(runner.calls) == 1  # it waits for the drawing, launching nothing yet
    ex.redraw = real
    release.set()
    clicked.join(30)
    ex.thread.join(30)
    assert ex.thread is not first and len(runner.calls) == 2 and len(ex.output.outputs) == 1
    # a click during a run (the button disabled, as the page shows it) starts nothing
    release.clear()
    alive = threading.Thread(target=lambda: release.wait(30))  # a run's thread, in flight
    alive.start()
    ex.thread, ex.button.disabled = alive, True
    ex.button.click()
    assert ex.thread is alive and len(runner.calls) == 2
    release.set()
    alive.join(30)
