"""Tests of the launcher's parameter-server mode (``num_ps``/``--ps``) and preemptions.

The fast tests run real processes on 127.0.0.1 with tiny Python scripts: a chief script, and
a fake server given as ``server_command`` (it binds its TF_CONFIG address like a real server,
records what it saw and serves until SIGTERM). One test runs a real TensorFlow
ParameterServerStrategy cluster with ``python -m tf_hetbatch.launch.server``.
"""

import glob
import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tf_hetbatch.launch import Preemption, launch
from tf_hetbatch.launch import __main__ as cli
from tf_hetbatch.launch.cluster import live_groups
from helpers import cgroups_writable, our_children

pytestmark = pytest.mark.cluster  # real worker processes (or subprocesses): see setup.cfg

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")

# A stand-in for `python -m tf_hetbatch.launch.server`: binds and listens on its TF_CONFIG address,
# writes <out>/<role><index>-<pid>.json, serves until SIGTERM (then exits 0). Options:
#   --die ROLE:INDEX:SECONDS:HOW   that task ends itself after SECONDS (HOW: kill or a code)
#   --busy ROLE:INDEX:SECONDS      that task busy-loops first, then writes its CPU use to
#                                  <out>/<role><index>-<pid>.rate (CPU s per wall s)
FAKE_SERVER = """
import json, os, signal, socket, sys, time
out, opts = sys.argv[1], sys.argv[2:]
cfg = json.loads(os.environ["TF_CONFIG"])
role, index = cfg["task"]["type"], cfg["task"]["index"]
host, port = cfg["cluster"][role][index].rsplit(":", 1)
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind((host, int(port)))
sock.listen()
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
keys = ["TF_HETBATCH_RESTART", "TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS", "EXTRA",
        "CUDA_VISIBLE_DEVICES"]
base = os.path.join(out, f"{role}{index}-{os.getpid()}")

def write(path, data):
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)

write(base + ".json", {"cfg": cfg, "pid": os.getpid(),
                       "env": {k: os.environ.get(k) for k in keys}})
print(f"serving {role} {index}", flush=True)
me = f"{role}:{index}:"
for flag, spec in zip(opts[::2], opts[1::2]):
    if spec.startswith(me) and flag == "--busy":
        seconds = float(spec.split(":")[2])
        cpu = lambda: sum(os.times()[:2])
        t0, c0 = time.monotonic(), cpu()
        while time.monotonic() - t0 < seconds:
            pass
        write(base + ".rate", (cpu() - c0) / (time.monotonic() - t0))
    if spec.startswith(me) and flag == "--die":
        _, _, seconds, how = spec.split(":")
        time.sleep(float(seconds))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(how))
while not stopping:
    time.sleep(0.02)
print(f"stopped {role} {index}", flush=True)
"""

# The chief: records its TF_CONFIG and pid, waits (at most 20 s) until `count` files match
# the glob `pattern` in <out>, sleeps `linger` s, then exits with `code`.
CHIEF = """
import glob, json, os, sys, time
out, pattern, count, linger, code = sys.argv[1:6]
cfg = json.loads(os.environ["TF_CONFIG"])
with open(os.path.join(out, f"chief-{os.getpid()}.json"), "w") as f:
    json.dump({"cfg": cfg, "pid": os.getpid(),
               "env": {k: os.environ.get(k)
                       for k in ["TF_HETBATCH_RESTART", "EXTRA", "CUDA_VISIBLE_DEVICES"]}}, f)
print("chief up", flush=True)
deadline = time.monotonic() + 20
while len(glob.glob(os.path.join(out, pattern))) < int(count):
    if time.monotonic() > deadline:
        print("chief gave up waiting", flush=True)
        sys.exit(99)
    time.sleep(0.02)
time.sleep(float(linger))
print("chief done", flush=True)
sys.exit(int(code))
"""


def write_script(tmp_path, body: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def ps_run(tmp_path, num_workers, num_ps=1, pattern="*-*.json", count=None, linger=0.0,
           code=0, server_opts=(), **kw):
    """Launches CHIEF + FAKE_SERVER; returns (result, stdout, stderr, seconds, records)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    chief = write_script(tmp_path, CHIEF, "chief.py")
    server = write_script(tmp_path, FAKE_SERVER, "fake_server.py")
    if count is None:  # Every server and the chief are up.
        count = 1 + num_ps + num_workers
    stdout, stderr = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    result = launch([chief, str(out), pattern, str(count), str(linger), str(code)],
                    num_workers, num_ps=num_ps, stdout=stdout, stderr=stderr,
                    server_command=[sys.executable, server, str(out), *server_opts], **kw)
    seconds = time.monotonic() - t0
    return result, stdout.getvalue(), stderr.getvalue(), seconds, records(out)


def records(out):
    """{"ps0": [record, ...], ...}: what each process recorded, in start order, with
    "rate" set from its .rate file (or None)."""
    found = {}
    paths = sorted(glob.glob(os.path.join(out, "*-*.json")), key=lambda p: os.stat(p).st_mtime_ns)
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        rate = path[:-len(".json")] + ".rate"
        record["rate"] = json.load(open(rate)) if os.path.exists(rate) else None
        found.setdefault(os.path.basename(path).rsplit("-", 1)[0], []).append(record)
    return found


def all_pids(recs):
    return [r["pid"] for rs in recs.values() for r in rs]


def assert_all_gone(recs):
    """Every process group the launch started is gone, and no child of ours is left."""
    pids = all_pids(recs)
    assert pids and live_groups(pids) == set(), pids
    kids = our_children()
    assert kids == []
    assert glob.glob(f"/sys/fs/cgroup/*/tf_hetbatch-{os.getpid()}-*") == []


@pytest.mark.timeout(60)
def test_every_task_gets_its_role_and_the_same_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")  # The launcher's GPUs: worker 0 gets "4".
    result, out, err, _, recs = ps_run(tmp_path, 2, num_ps=2, threads=1, env={"EXTRA": "x"},
                                       gpus="1|")
    assert result.ok and result.returncode == 0, (result.message, out, err)
    assert sorted(recs) == ["chief", "ps0", "ps1", "worker0", "worker1"]
    cluster = recs["chief"][0]["cfg"]["cluster"]
    assert sorted(cluster) == ["chief", "ps", "worker"]
    assert [len(cluster[r]) for r in ("chief", "ps", "worker")] == [1, 2, 2]
    addresses = cluster["chief"] + cluster["ps"] + cluster["worker"]
    assert len(set(addresses)) == 5 and all(a.startswith("127.0.0.1:") for a in addresses)
    for name, (rec,) in recs.items():
        role = re.match(r"[a-z]+", name).group()
        index = 0 if role == "chief" else int(name[len(role):])
        assert rec["cfg"] == {"cluster": cluster, "task": {"type": role, "index": index}}
        assert rec["env"]["TF_HETBATCH_RESTART"] == "0" and rec["env"]["EXTRA"] == "x"
        # GPUs go to the worker tasks; chief and ps get none.
        gpus = "4" if name == "worker0" else ""
        assert rec["env"]["CUDA_VISIBLE_DEVICES"] == gpus, (name, rec["env"])
        if role != "chief":
            # threads=1, but a ParameterServerStrategy worker needs 2 inter-op threads.
            interop = "2" if role == "worker" else "1"
            assert rec["env"]["TF_NUM_INTEROP_THREADS"] == interop, (name, rec["env"])
            assert rec["env"]["TF_NUM_INTRAOP_THREADS"] == "1"
    # Output prefixes name the task.
    assert "[chief] chief up\n" in out and "[chief] chief done\n" in out
    for name in ("ps 0", "ps 1", "worker 0", "worker 1"):
        assert f"[{name}] serving {name}\n" in out
        assert f"[{name}] stopped {name}\n" in out  # Stopped by SIGTERM after the chief.
    # The result describes every task.
    assert result.chief.role == "chief" and result.chief.returncode == 0
    assert result.chief.ok and not result.chief.stopped_by_launcher
    assert [(t.role, t.index) for t in result.ps] == [("ps", 0), ("ps", 1)]
    assert [(t.role, t.index) for t in result.workers] == [("worker", 0), ("worker", 1)]
    for task in result.ps + result.workers:
        assert task.stopped_by_launcher and task.returncode == 0, task
    assert [t.name for t in result.tasks] == ["chief", "ps 0", "ps 1", "worker 0", "worker 1"]
    assert result.failed_task is None and result.failed_worker is None
    assert "chief exited 0; stopped 2 ps and 2 worker tasks" in result.message
    assert_all_gone(recs)


@pytest.mark.timeout(60)
def test_chief_failure_is_the_jobs_failure(tmp_path):
    result, out, _, elapsed, recs = ps_run(tmp_path, 2, code=3)
    assert elapsed < 15
    assert result.returncode == 3 and not result.ok
    assert result.failed_task.role == "chief" and result.failed_task.returncode == 3
    assert result.failed_worker is None
    assert result.message.startswith("chief failed: exit code 3; stopped the ps and worker "
                                      "tasks"), result.message
    for task in result.ps + result.workers:
        assert task.stopped_by_launcher
    assert_all_gone(recs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, code, described", [
    ("kill", 128 + signal.SIGKILL, "killed by signal SIGKILL"),
    ("0", 1, "exit code 0"),  # A ps that ends "successfully" under a running chief: fatal.
])
def test_a_ps_that_dies_is_fatal(tmp_path, how, code, described):
    # The chief would wait 30 s; the ps dies 0.3 s after it is up.
    result, out, _, elapsed, recs = ps_run(tmp_path, 2, linger=30,
                                           server_opts=["--die", f"ps:0:0.3:{how}"], grace=1.0)
    assert elapsed < 15, result.message
    assert result.returncode == code and not result.ok
    assert result.failed_task.role == "ps" and result.failed_task.index == 0
    assert result.failed_worker is None
    assert result.message.startswith(f"ps 0 failed before the chief finished: {described}; "
                                      "stopped the other tasks"), result.message
    assert result.chief.stopped_by_launcher
    assert "[chief] chief done" not in out
    assert_all_gone(recs)


@pytest.mark.timeout(60)
def test_lost_workers_are_not_fatal_with_parameter_servers(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tf_hetbatch.launch")
    # Worker 0 exits with code 7 by itself, worker 1 is preempted (SIGKILL) and stays down;
    # the chief lingers 3 s after everyone was up and then succeeds. (1.5 s: after every
    # task started, also on a loaded machine.)
    result, out, _, _, recs = ps_run(tmp_path, 3, linger=3.0, preempt="1.5:1",
                                     server_opts=["--die", "worker:0:0.2:7"])
    assert result.ok, result.message
    assert "tolerated 2 worker exits" in result.message
    w0, w1, w2 = result.workers
    assert w0.returncode == 7 and not w0.stopped_by_launcher and not w0.preempted
    assert w1.returncode == -signal.SIGKILL and w1.preempted and w1.restarts == 0
    assert "(preempted)" in w1.describe()
    assert w2.stopped_by_launcher and w2.returncode == 0
    assert result.ps[0].stopped_by_launcher
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("worker 0 ended: exit code 7; not fatal" in w for w in warnings), warnings
    assert any("worker 1 ended: killed by signal SIGKILL (preempted); not fatal" in w
               for w in warnings), warnings
    assert any("preempted worker 1" in e for e in result.events), result.events
    assert "[worker 1] stopped" not in out  # It never came back.
    assert_all_gone(recs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["cgroup", "duty-cycle"])
def test_preempted_worker_comes_back_with_its_tf_config_address_and_cap(tmp_path, method):
    if method == "cgroup" and not cgroups_writable():
        pytest.skip("cgroup cpu hierarchy not writable here (needs root or delegation)")
    # Worker 0 (cap 0.2 CPUs) busy-loops 3 s and reports its CPU use; it is preempted at
    # 1.2 s (after it started, even on a loaded machine; before it can report), and started
    # again 0.3 s later. The chief ends once the second process of worker 0 has reported.
    result, out, _, _, recs = ps_run(
        tmp_path, 2, pattern="worker0-*.rate", count=1, preempt="1.2:0+0.3",
        server_opts=["--busy", "worker:0:3"], cpus=[0.2, None], cap_method=method)
    assert result.ok and result.cap_method.startswith(method), result.message
    first, second = recs["worker0"]
    assert first["pid"] != second["pid"]
    assert first["cfg"] == second["cfg"]  # Same TF_CONFIG, so the same address...
    assert second["cfg"]["task"] == {"type": "worker", "index": 0}
    # ...which the new process could bind again (else it would have died and the chief
    # would have given up waiting).
    assert first["rate"] is None and second["rate"] is not None
    assert second["rate"] < 0.4, second["rate"]  # Still capped at 0.2 CPUs.
    w0 = result.workers[0]
    assert w0.restarts == 1 and not w0.preempted and w0.stopped_by_launcher
    assert [e.split(": ", 1)[1].split(" (")[0] for e in result.events] == [
        "preempted worker 0", "worker 0 ended: killed by signal SIGKILL", "started worker 0 again"]
    assert out.count("[worker 0] serving worker 0\n") == 2
    assert len(recs["worker1"]) == 1 and len(recs["ps0"]) == 1
    assert_all_gone(recs)


WORKER_SLEEPS = """
import json, os, sys, time
attempt = os.environ["TF_HETBATCH_RESTART"]
i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
open(os.path.join(sys.argv[1], f"a{attempt}w{i}-{os.getpid()}"), "w").close()
time.sleep(60 if attempt == "0" else 2.0)
"""


@pytest.mark.timeout(60)
def test_preemption_without_ps_ends_the_attempt_and_max_restarts_restarts(tmp_path):
    script = write_script(tmp_path, WORKER_SLEEPS, "worker.py")
    out = io.StringIO()
    # Attempt 0 is preempted at 1.5 s (after its workers started, also on a loaded
    # machine); the event happens once, so attempt 1 (which runs past 1.5 s) finishes.
    result = launch([script, str(tmp_path)], 2, preempt="1.5:1", max_restarts=1, grace=1.0,
                    stdout=out, stderr=out)
    assert result.ok and result.attempts == 2, result.message
    assert [e.split(": ", 1)[1].split(" (")[0] for e in result.events] == ["preempted worker 1"]
    pids = [int(p.rsplit("-", 1)[1]) for p in glob.glob(str(tmp_path / "a*w*-*"))]
    assert len(pids) == 4 and live_groups(pids) == set()

    result = launch([script, str(tmp_path)], 2, preempt=[Preemption(1.5, 1)], grace=1.0,
                    stdout=out, stderr=out)
    assert result.returncode == 128 + signal.SIGKILL and result.failed_worker == 1
    assert result.failed_task.role == "worker" and result.workers[1].preempted
    assert result.message.startswith("worker 1 failed: killed by signal SIGKILL (preempted); "
                                      "stopped the other workers"), result.message
    assert result.workers[0].stopped_by_launcher and result.chief is None and result.ps == ()


# On SIGTERM, worker 1 "saves" (a file, 4 s later: longer than the former default grace of
# 3 s, as a real save and exit can be); every worker exits with RESTART_EXIT_CODE once it
# sees that file, as tf_hetbatch workers all save at one agreed step. With "ignore", the
# SIGTERM does nothing.
WORKER_ON_NOTICE = """
import json, os, signal, sys, time
attempt = os.environ["TF_HETBATCH_RESTART"]
i = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
saved = os.path.join(sys.argv[1], f"saved-a{attempt}")
if sys.argv[2] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: time.sleep(4) or open(saved, "w").close())
open(os.path.join(sys.argv[1], f"a{attempt}w{i}-{os.getpid()}"), "w").close()
end = time.monotonic() + (30 if attempt == "0" else 0.5)
while time.monotonic() < end:
    if os.path.exists(saved):
        sys.exit(42)
    time.sleep(0.02)
"""


@pytest.mark.timeout(60)
def test_a_notice_and_the_restart_exit_code_restart_the_cluster_without_a_failure(tmp_path):
    script = write_script(tmp_path, WORKER_ON_NOTICE, "worker.py")
    out = io.StringIO()
    result = launch([script, str(tmp_path), "save"], 2, preempt="1.5:1/term", max_restarts=0,
                    stdout=out, stderr=out)  # the default grace covers the save
    assert result.ok and result.attempts == 2, result.message
    assert "1 restart after preemption notices" in result.message
    assert any("notice to worker 1 (SIGTERM" in e for e in result.events), result.events
    assert any("worker 1 exited" in e and "after its notice: exit code 42" in e
               for e in result.events), result.events
    pids = [int(p.rsplit("-", 1)[1]) for p in glob.glob(str(tmp_path / "a*w*-*"))]
    assert len(pids) == 4 and live_groups(pids) == set()


@pytest.mark.timeout(60)
def test_a_notice_that_is_not_acted_on_ends_in_a_sigkill_after_the_grace(tmp_path):
    script = write_script(tmp_path, WORKER_ON_NOTICE, "worker.py")
    out = io.StringIO()
    t0 = time.monotonic()
    result = launch([script, str(tmp_path), "ignore"], 2, preempt=[Preemption(1.0, 1,
                                                                               notice=True)],
                    grace=1.0, stdout=out, stderr=out)
    assert result.returncode == 128 + signal.SIGKILL and result.failed_worker == 1
    assert result.workers[1].preempted and time.monotonic() - t0 >= 2.0
    assert any("still ran 1 s after its notice: SIGKILL" in e for e in result.events)
    pids = [int(p.rsplit("-", 1)[1]) for p in glob.glob(str(tmp_path / "a*w*-*"))]
    assert len(pids) == 2 and live_groups(pids) == set()


@pytest.mark.timeout(60)
def test_timeout_in_ps_mode_stops_every_task(tmp_path):
    result, _, _, elapsed, recs = ps_run(tmp_path, 1, linger=30, timeout=2.0, grace=1.0)
    assert result.returncode == 124 and "stopped all tasks" in result.message
    assert elapsed < 10 and result.chief.stopped_by_launcher
    assert_all_gone(recs)


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_ps=-1), ["`num_ps` must be an integer >= 0", "Received: num_ps=-1", "Fix"]),
    (dict(num_ps=1.5), ["`num_ps`", "num_ps=1.5"]),
    (dict(preempt="1:5"), ["worker 5", "only 2 workers", "Fix"]),
    (dict(preempt="1:5", num_ps=1), ["worker 5", "only 2 workers"]),
    (dict(preempt="1:1+2"), ["'1:1+2'", "needs parameter servers", "--ps 1", "--max-restarts"]),
    (dict(preempt=[Preemption(1, 0, 3)]), ["'1:0+3'", "needs parameter servers"]),
    (dict(preempt="5"), ["--preempt", "no ':'", "'5'"]),
    (dict(preempt="5:x"), ["--preempt", "'x'", "WORKER+DOWN_SECONDS"]),
    (dict(preempt="-1:0"), ["--preempt", "at=-1.0", ">= 0"]),
    (dict(preempt="5:0+-1", num_ps=1), ["restart_after=-1.0", ">= 0"]),
    (dict(preempt=";"), ["--preempt is empty"]),
    (dict(preempt="5:0/hup"), ["--preempt", "'0/hup'", "WORKER/term"]),
    (dict(server_command=["srv"]), ["server_command", "num_ps=0", "Fix"]),
    (dict(server_command="srv", num_ps=1), ["server_command", "list of strings"]),
])
def test_bad_arguments_fail_early_naming_the_value(tmp_path, kwargs, words):
    script = write_script(tmp_path, "print('never runs')\n", "worker.py")
    with pytest.raises(ValueError) as info:
        launch([script], 2, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_preemption_values_are_checked():
    with pytest.raises(TypeError, match="list of Preemption"):
        launch([__file__], 2, preempt=[(1, 0)])
    with pytest.raises(ValueError, match="index >= 0"):
        Preemption(1, -1)
    with pytest.raises(ValueError, match="seconds >= 0"):
        Preemption(float("nan"), 0)
    assert str(Preemption(30, 1, 10)) == "30:1+10" and str(Preemption(5, 0)) == "5:0"
    assert str(Preemption(5, 0, 2, notice=True)) == "5:0/term+2"
    with pytest.raises(ValueError, match="notice"):
        Preemption(1, 0, notice="yes")


@pytest.mark.parametrize("argv, words", [
    (["--workers", "2", "--ps", "-1"], ["--ps must be >= 0", "--ps -1"]),
    (["--workers", "2", "--preempt", "1:0+1"], ["needs parameter servers", "--ps 1"]),
    (["--workers", "2", "--ps", "1", "--preempt", "1:2"], ["worker 2", "only 2"]),
    (["--workers", "2", "--preempt", "1=0"], ["--preempt", "no ':'"]),
])
def test_cli_rejects_bad_ps_and_preempt_arguments(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, __file__])  # An existing script; it never runs.
    assert info.value.code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


@pytest.mark.timeout(60)
def test_cli_preemption_without_ps_exits_with_the_signal_status(tmp_path):
    script = write_script(tmp_path, "import time; time.sleep(60)\n", "worker.py")
    proc = subprocess.run([sys.executable, "-m", "tf_hetbatch.launch", "--workers", "2",
                           "--preempt", "0.3:1", "--grace", "1", script],
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "preempted worker 1" in proc.stderr
    assert "worker 1 failed: killed by signal SIGKILL (preempted)" in proc.stderr


@pytest.mark.timeout(180)
def test_stock_parameter_server_strategy_trains_on_a_launched_cluster():
    """Real TensorFlow: chief + 1 ps + 2 workers (`python -m tf_hetbatch.launch.server`)."""
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    result = launch([os.path.join(WORKERS, "ps_stock_chief.py"), "--steps", "50"], 2,
                    num_ps=1, threads=1, timeout=150,
                    env={"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO},
                    stdout=out, stderr=err)
    elapsed = time.monotonic() - t0
    text = out.getvalue()
    assert result.ok, (result.message, text[-3000:], err.getvalue()[-3000:])
    losses = {k: float(v) for k, v in re.findall(r"^\[chief\] (first|final) loss (\S+)$", text,
                                                 re.M)}
    assert set(losses) == {"first", "final"}, text[-3000:]
    assert math.isfinite(losses["final"]) and losses["final"] < losses["first"], losses
    assert result.chief.returncode == 0
    for task in result.ps + result.workers:
        assert task.stopped_by_launcher
    print(f"stock PSS launch took {elapsed:.1f} s; losses {losses}")
