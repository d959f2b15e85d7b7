"""Tests of the local cluster launcher, with plain-Python worker scripts (no TensorFlow)."""

import glob
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tf_hetbatch.launch import CapChange, launch
from tf_hetbatch.launch import __main__ as cli
from tf_hetbatch.launch.schedule import available_cpus
from helpers import cgroups_writable, our_children

pytestmark = pytest.mark.cluster  # real worker processes (or subprocesses): see setup.cfg

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Busy loop for DURATION s; prints its CPU use (CPU s / wall s) per WINDOW s and overall.
BUSY = """
import os, sys, time
duration, window = float(sys.argv[1]), float(sys.argv[2])
cpu = lambda: sum(os.times()[:2])
t0 = time.monotonic(); c0 = cpu(); ws, wc = t0, c0
while True:
    now = time.monotonic()
    if now - ws >= window:
        c = cpu(); print(f"window {now - t0:.2f} {(c - wc) / (now - ws):.3f}"); ws, wc = now, c
    if now - t0 >= duration:
        break
print(f"total {(cpu() - c0) / (time.monotonic() - t0):.3f}")
"""


def write_script(tmp_path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run(script, n, **kw):
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    result = launch(script if isinstance(script, list) else [script], n, stdout=out,
                    stderr=err, **kw)
    return result, out.getvalue(), err.getvalue(), time.monotonic() - t0


def idle_seconds() -> float:
    """CPU-seconds the machine's cores have spent idle since boot (/proc/stat idle + iowait)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def our_cgroups():
    return glob.glob(f"/sys/fs/cgroup/*/tf_hetbatch-{os.getpid()}-*") + glob.glob(
        f"/sys/fs/cgroup/*/*/tf_hetbatch-{os.getpid()}-*")


def cpu_use(output: str, worker: int) -> float:
    lines = [l for l in output.splitlines() if l.startswith(f"[worker {worker}] total ")]
    assert lines, output
    return float(lines[-1].split()[-1])


def windows(output: str, worker: int):
    return [tuple(map(float, l.split()[-2:])) for l in output.splitlines()
            if l.startswith(f"[worker {worker}] window ")]


@pytest.mark.timeout(30)
def test_each_worker_gets_its_tf_config_on_distinct_loopback_ports(tmp_path):
    script = write_script(tmp_path, """
        import json, os, sys
        cfg = json.loads(os.environ["TF_CONFIG"])
        keys = ["TF_HETBATCH_RESTART", "TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS",
                "OMP_NUM_THREADS", "EXTRA"]
        out = {"cfg": cfg, "env": {k: os.environ.get(k) for k in keys}}
        with open(os.path.join(sys.argv[1], f"w{cfg['task']['index']}.json"), "w") as f:
            json.dump(out, f)
    """)
    result, _, _, _ = run([script, str(tmp_path)], 3, threads=2, env={"EXTRA": "x"})
    assert result.ok and result.returncode == 0, result.message
    seen = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(3)]
    workers = seen[0]["cfg"]["cluster"]["worker"]
    assert len(workers) == 3 and len(set(workers)) == 3
    for i, s in enumerate(seen):
        assert s["cfg"] == {"cluster": {"worker": workers},
                            "task": {"type": "worker", "index": i}}
        assert s["env"] == {"TF_HETBATCH_RESTART": "0", "TF_NUM_INTEROP_THREADS": "2",
                            "TF_NUM_INTRAOP_THREADS": "2", "OMP_NUM_THREADS": "2",
                            "EXTRA": "x"}
    for address in workers:
        host, port = address.split(":")
        assert host == "127.0.0.1" and 0 < int(port) < 65536


@pytest.mark.timeout(30)
def test_output_lines_are_prefixed_with_the_worker(tmp_path):
    script = write_script(tmp_path, """
        import json, os, sys
        i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        print(f"out of {i}\\nsecond line"); print(f"err of {i}", file=sys.stderr)
        sys.stdout.write("no newline at end")
    """)
    result, out, err, _ = run(script, 2)
    assert result.ok, result.message
    for i in range(2):
        assert f"[worker {i}] out of {i}\n" in out
        assert f"[worker {i}] second line\n" in out
        assert f"[worker {i}] no newline at end\n" in out
        assert f"[worker {i}] err of {i}\n" in err


@pytest.mark.timeout(30)
def test_failing_worker_stops_the_others_and_is_reported(tmp_path):
    script = write_script(tmp_path, """
        import json, os, sys, time
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
            time.sleep(0.3); sys.exit(3)
        time.sleep(60)
    """)
    result, _, _, elapsed = run(script, 3)
    assert elapsed < 10
    assert result.returncode == 3 and result.failed_worker == 1 and not result.ok
    assert "worker 1" in result.message and "exit code 3" in result.message
    assert result.workers[1].returncode == 3
    for i in (0, 2):
        assert result.workers[i].stopped_by_launcher
        assert result.workers[i].returncode == -signal.SIGTERM
    assert our_children() == []


@pytest.mark.timeout(30)
def test_worker_killed_by_a_signal_is_reported_by_signal_name(tmp_path):
    script = write_script(tmp_path, """
        import json, os, signal, time
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    result, _, _, elapsed = run(script, 2)
    assert elapsed < 10
    assert result.failed_worker == 0 and result.returncode == 128 + signal.SIGKILL
    assert "worker 0" in result.message and "SIGKILL" in result.message


@pytest.mark.timeout(30)
def test_max_restarts_relaunches_on_new_ports_until_success(tmp_path):
    script = write_script(tmp_path, """
        import json, os, sys
        attempt = os.environ["TF_HETBATCH_RESTART"]
        cfg = json.loads(os.environ["TF_CONFIG"])
        with open(os.path.join(sys.argv[1], f"a{attempt}w{cfg['task']['index']}"), "w") as f:
            f.write(",".join(cfg["cluster"]["worker"]))
        sys.exit(5 if attempt == "0" and cfg["task"]["index"] == 1 else 0)
    """)
    result, _, _, _ = run([script, str(tmp_path)], 2, max_restarts=2)
    assert result.ok and result.attempts == 2, result.message
    # Worker 1 wrote its cluster in both attempts (worker 0 may be stopped before it starts
    # when worker 1 fails first): the relaunch has new ports.
    assert (tmp_path / "a0w1").read_text() != (tmp_path / "a1w1").read_text()
    result, _, _, _ = run([script, str(tmp_path)], 2, max_restarts=0)
    assert result.returncode == 5 and result.attempts == 1


@pytest.mark.timeout(30)
def test_cleanup_leaves_no_processes_or_cgroups_after_failure(tmp_path):
    script = write_script(tmp_path, """
        import json, os, subprocess, sys, time
        i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        if i == 0:
            child = subprocess.Popen(["sleep", "60"])
            with open(os.path.join(sys.argv[1], "grandchild"), "w") as f:
                f.write(str(child.pid))
            time.sleep(60)
        time.sleep(1.0); sys.exit(1)
    """)
    result, _, _, elapsed = run([script, str(tmp_path)], 2, cpus=[0.5, 0.5])
    assert result.failed_worker == 1 and elapsed < 10
    grandchild = int((tmp_path / "grandchild").read_text())
    deadline = time.monotonic() + 3
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)
    assert our_children() == []
    assert our_cgroups() == []


@pytest.mark.timeout(30)
def test_timeout_stops_everything_with_code_124(tmp_path):
    script = write_script(tmp_path, "import time; time.sleep(60)\n")
    result, _, _, elapsed = run(script, 2, timeout=1.0)
    assert result.returncode == 124 and "timed out" in result.message
    assert elapsed < 8 and our_children() == []


@pytest.mark.timeout(30)
def test_sigterm_to_the_launcher_stops_the_cluster(tmp_path):
    script = write_script(tmp_path, """
        import json, os, sys, time
        i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        open(os.path.join(sys.argv[1], f"pid{i}"), "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-m", "tf_hetbatch.launch", "--workers", "2",
                             "--cpus", "0.5,none", script, str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not all((tmp_path / f"pid{i}").exists() for i in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in err
    for i in range(2):
        assert not alive(int((tmp_path / f"pid{i}").read_text()))
    assert glob.glob(f"/sys/fs/cgroup/*/tf_hetbatch-{proc.pid}-*") == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", ["cgroup", "duty-cycle"])
def test_cpu_caps_limit_a_busy_worker(tmp_path, method):
    if method == "cgroup" and not cgroups_writable():
        pytest.skip("cgroup cpu hierarchy not writable here (needs root or delegation)")
    script = write_script(tmp_path, BUSY)
    idle_before = idle_seconds()
    result, out, _, elapsed = run([script, "2.5", "1"], 2, cpus=[0.2, 0.5], cap_method=method)
    idle_cores = (idle_seconds() - idle_before) / elapsed
    assert result.ok and result.cap_method.startswith(method), result.message
    # A cap is a ceiling. A worker far under its cap while half a core sat idle was held back
    # by a cap too tight; on a machine busy with other work (the suite's other processes) a
    # worker may get less than its cap, so there the floor is not judged.
    assert cpu_use(out, 0) <= 0.35 and cpu_use(out, 1) <= 0.65, out
    if idle_cores >= 0.5:
        assert cpu_use(out, 0) >= 0.1 and cpu_use(out, 1) >= 0.2, (idle_cores, out)
    assert our_cgroups() == []


@pytest.mark.timeout(30)
def test_schedule_changes_a_cap_mid_run(tmp_path):
    script = write_script(tmp_path, BUSY)
    result, out, _, _ = run([script, "2.8", "0.4"], 1, cpus=[0.9],
                            schedule=[CapChange(1.2, 0, 0.1)])
    assert result.ok, result.message
    rates = windows(out, 0)
    before = [r for t, r in rates if t <= 1.2]
    after = [r for t, r in rates if t >= 1.7]
    assert before and after, out
    mean_before, mean_after = sum(before) / len(before), sum(after) / len(after)
    assert mean_after < 0.2 and mean_before > 2 * mean_after, out


@pytest.mark.parametrize("kwargs, words", [
    (dict(cpus=[0.5]), ["one cap per worker", "2 workers", "[0.5]"]),
    (dict(cpus=[0.5, 0]), ["cpus[1]", "Received: 0"]),
    (dict(cpus=[0.5, available_cpus() + 1]), ["cpus[1]", f"(0, {available_cpus()}]"]),
    (dict(cpus="0.5,abc"), ["--cpus[1]", "'abc'"]),
    (dict(schedule="30=1:0.1"), ["--schedule", "'30=1'", "not a number"]),
    (dict(schedule="30:1-0.1"), ["WORKER=CAP", "'1-0.1'"]),
    (dict(schedule="x:1=0.1"), ["'x'", "seconds"]),
    (dict(schedule="5:7=0.1"), ["worker 7", "only 2 workers"]),
    (dict(cpus=[0.5, 0.5], cap_method="none"), ["cap_method='none'", "Fix"]),
    (dict(cap_method="fast"), ["cap_method", "'fast'"]),
    (dict(max_restarts=-1), ["max_restarts", "-1"]),
    (dict(timeout=0), ["timeout", "0"]),
])
def test_bad_arguments_fail_early_naming_the_value(tmp_path, kwargs, words):
    script = write_script(tmp_path, "print('never runs')\n")
    with pytest.raises(ValueError) as info:
        launch([script], 2, **kwargs)
    for word in words:
        assert word in str(info.value)
    assert our_children() == [] and our_cgroups() == []


def test_missing_script_and_cli_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="not found: 'nope.py'"):
        launch(["nope.py"], 2)
    with pytest.raises(SystemExit) as info:
        cli.main(["--workers", "2", "--cpus", "0.1,0.2,0.3", "x.py"])
    assert info.value.code == 2
    assert "--cpus must give one cap per worker (2 workers)" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_cli_runs_a_script_and_returns_its_status(tmp_path):
    script = write_script(tmp_path, "import sys; print('hi', sys.argv[1:]); sys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-m", "tf_hetbatch.launch", "--workers", "2",
                           "--schedule", "0.1:1=0.5", script, "--steps", "3"],
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "[worker 1] hi ['--steps', '3']" in proc.stdout
    assert "all 2 workers exited 0" in proc.stderr


def test_launcher_does_not_import_tensorflow():
    code = ("import sys; sys.modules['tensorflow'] = None; import tf_hetbatch.launch, "
            "tf_hetbatch.launch.__main__; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "ok", proc.stderr
