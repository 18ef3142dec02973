"""How the GPU tests start a Python child process: without the environment's gpumem settings (each test
sets the ones it means), and, for children that start children of their own (inductor's compile workers,
spawned processes), in a process group of their own, killed whole when it runs out of time; and how
torchrun children report their results (one ``RESULT {json}`` line per rank, on a stdout the ranks share)."""
import json
import os
import signal
import subprocess
import sys

GPUMEM_SETTINGS = ("GPUMEM_CONF", "GPUMEM_DISABLE")


def clean_env(**extra):
    """os.environ without GPUMEM_CONF and GPUMEM_DISABLE, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in GPUMEM_SETTINGS}
    env.update(extra)
    return env


def child_facts(code, conf, *args, timeout=300):
    """Runs ``python -c code *args`` with ``GPUMEM_CONF=conf`` (nothing else of gpumem's settings) and
    returns the dict of its ``FACTS {json}`` line; a child that fails fails the test with its stderr.
    Skips the test without a CUDA GPU."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = subprocess.run([sys.executable, "-c", code, *args], env=clean_env(GPUMEM_CONF=conf),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("FACTS "))
    return json.loads(line[len("FACTS "):])


def start(cmd, env, cwd=None):
    """The child in a new session (its own process group), stdout and stderr captured as text."""
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc, timeout):
    """(stdout, stderr, timed_out): waits up to `timeout` seconds, then kills the child's process group."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return out, err, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return out, err, True


def print_result(row):
    """``RESULT {json}`` in one write: print() writes the text and its newline apart, so on unbuffered
    output (PYTHONUNBUFFERED) two ranks' lines could run together."""
    sys.stdout.write("RESULT " + json.dumps(row) + "\n")
    sys.stdout.flush()


def read_results(out):
    """Every ``RESULT {json}`` object in `out`, in order, wherever a line break fell."""
    decoder, rows, at = json.JSONDecoder(), [], out.find("RESULT ")
    while at >= 0:
        row, end = decoder.raw_decode(out, at + len("RESULT "))
        rows.append(row)
        at = out.find("RESULT ", end)
    return rows
