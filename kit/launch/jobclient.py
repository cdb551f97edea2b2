"""A rank of a user's script as torchrun starts it (``torchrun --no-python python -S jobclient.py SOCKET SERVER_PID PROGRAM...``):
it asks the job server at SOCKET (``gradkit.launch.jobserver``) to fork the rank with this process's environment,
folder, arguments and standard streams, forwards the signals torchrun sends it, and exits as the rank did. Where no
server answers, or it answers that it cannot fork, this process becomes ``python -u PROGRAM...`` itself.

Standard library only, run by path with ``-S``: it starts in milliseconds, importing nothing of the stack."""
import array
import json
import os
import signal
import socket
import struct
import sys
import time

WAIT_S = 300.0  # the server binds its socket before it imports: it is there in well under a second


def _fresh(program: list) -> None:
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-u", *program])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def main(path: str, server: int, program: list) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline or not _alive(server):
                _fresh(program)
            time.sleep(0.05)
    body = json.dumps({"argv": program, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    sock.sendmsg([struct.pack("!I", len(body)) + body],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    pid = [0]

    def forward(sig, _frame):
        if pid[0]:
            try:
                os.kill(pid[0], sig)
            except OSError:
                pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    reader = sock.makefile("r")
    for line in reader:
        said = json.loads(line)
        if "fallback" in said:
            sock.close()
            _fresh(program)
        if "pid" in said:
            pid[0] = said["pid"]
        if "status" in said:
            status = said["status"]
            if status < 0:  # killed by a signal: so is this process, as torchrun would see the rank die
                signal.signal(-status, signal.SIG_DFL)
                os.kill(os.getpid(), -status)
            sys.exit(status)
    sys.stderr.write("gradkit job server: it left before the rank ended\n")
    sys.exit(70)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
