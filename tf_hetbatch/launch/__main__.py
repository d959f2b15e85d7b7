"""Command line: ``python -m tf_hetbatch.launch --workers 2 [options] script.py [args...]``.

Also installed as ``tf-hetbatch-launch``. Examples::

    tf-hetbatch-launch --workers 2 train.py --epochs 3
    tf-hetbatch-launch --workers 3 --cpus 0.2,0.3,0.9 --threads 1 train.py
    tf-hetbatch-launch --workers 2 --cpus 0.8,0.8 --schedule "30:1=0.2;60:1=0.8" train.py
    tf-hetbatch-launch --workers 2 --max-restarts 3 --timeout 600 train.py
    tf-hetbatch-launch --workers 2 --preempt 60:1 --max-restarts 1 train.py
    tf-hetbatch-launch --workers 2 --preempt 60:1/term train.py   # a notice (SIGTERM)
    tf-hetbatch-launch --workers 3 --gpus "0,1|2|" train.py   # worker 2 CPU-only

    # ParameterServerStrategy: the chief runs train_ps.py; 1 ps and 3 workers run
    # `python -m tf_hetbatch.launch.server`. Worker 2 is preempted at 30 s and back at 45 s.
    tf-hetbatch-launch --ps 1 --workers 3 --cpus 0.9,0.5,0.2 --preempt "30:2+15" train_ps.py

Exit status: 0 only if all workers exit 0 (with --ps: the chief exits 0); otherwise the
failed task's code (128+signal if it died by a signal; a worker without --ps, the chief or a
ps with --ps), 124 on --timeout, 130/143 when interrupted; 2 for bad arguments. A task that
exits with 42 (tf_hetbatch.RESTART_EXIT_CODE: it saved on a preemption notice) restarts the
cluster, not counted in --max-restarts.
"""

import argparse
import logging
import sys
from typing import List, Optional

from tf_hetbatch.launch import launch
from tf_hetbatch.launch.cpu_caps import CAP_METHODS
from tf_hetbatch.launch.schedule import parse_cpus, parse_preemptions, parse_schedule
from tf_hetbatch.launch.supervisor import DEFAULT_GRACE_S


def build_parser() -> argparse.ArgumentParser:
    """Returns the argument parser of the launcher."""
    p = argparse.ArgumentParser(
        prog="tf-hetbatch-launch",
        description="Run a training script as N TF_CONFIG worker processes on 127.0.0.1 "
                    "(or, with --ps, as the chief of a parameter-server cluster), "
                    "optionally with CPU caps per worker and preemptions.",
        epilog="Everything after the script path is passed to the script.")
    p.add_argument("--workers", type=int, required=True, metavar="N",
                   help="number of worker processes (with --ps: worker tasks that serve "
                        "while the chief runs the script)")
    p.add_argument("--ps", type=int, default=0, metavar="N",
                   help="number of parameter servers; N >= 1 starts a ParameterServerStrategy "
                        "cluster: a chief runs the script, N ps and the workers run "
                        "`python -m tf_hetbatch.launch.server`; the chief's exit decides, a ps "
                        "failure is fatal, a lost worker is only logged (default 0: workers "
                        "only, MultiWorkerMirroredStrategy)")
    p.add_argument("--cpus", metavar="C0,C1,...",
                   help="CPU cap per worker, e.g. 0.2,0.3,0.9 ('none' = uncapped)")
    p.add_argument("--schedule", metavar="T:W=C;...",
                   help="cap changes mid-run, seconds since start: worker=cap, e.g. "
                        "'30:1=0.1;60:1=0.3,0=none'")
    p.add_argument("--preempt", metavar="T:W[/term][+D];...",
                   help="preempt workers: at T seconds after the first start SIGKILL worker W "
                        "(its process group), or with /term give it a notice: SIGTERM, then "
                        "SIGKILL after --grace seconds if it still runs; with +D start it "
                        "again D seconds later with the same TF_CONFIG and cap (needs --ps), "
                        "e.g. '30:1+10;60:0/term'. Without --ps a SIGKILL is a worker "
                        "failure, and a notice makes tf_hetbatch workers save and exit 42, "
                        "which restarts the cluster")
    p.add_argument("--gpus", metavar="G0|G1|...",
                   help="each worker's GPUs (its CUDA_VISIBLE_DEVICES): one group per worker, "
                        "separated by '|', of GPU indices (positions in the launcher's "
                        "CUDA_VISIBLE_DEVICES if set, else in `nvidia-smi -L`), e.g. "
                        "'0,1|2,3'; an empty group or 'none' for a CPU-only worker ('0|1|'); "
                        "'none': all CPU-only; 'all': leave CUDA_VISIBLE_DEVICES alone. "
                        "Default 'auto': one GPU per worker, workers beyond the GPU count "
                        "CPU-only; without GPUs nothing is set. With --ps the groups are the "
                        "worker tasks'; chief and ps get no GPU")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart the whole cluster up to N times after a failure (default 0)")
    p.add_argument("--cap-method", choices=CAP_METHODS, default="auto",
                   help="how caps are enforced (default auto: cgroup v1, v2, duty cycle)")
    p.add_argument("--period-ms", type=float, default=None, metavar="MS",
                   help="cap period (default 10 for cgroups, 100 for the duty cycle)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop everything after this many seconds (exit 124)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="set TF_NUM_INTEROP_THREADS, TF_NUM_INTRAOP_THREADS, OMP_NUM_THREADS "
                        "(with --ps, worker tasks get at least 2 inter-op threads)")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="seconds between SIGTERM and SIGKILL when stopping, and after a "
                        "/term preemption notice (default %(default)g: a tf_hetbatch "
                        "worker's save and exit on a notice took up to 7.5 s, and 30 s is "
                        "Kubernetes' default terminationGracePeriodSeconds; tasks that exit "
                        "sooner are not waited for)")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings from the launcher")
    p.add_argument("script", help="training script (.py, or any executable)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="[launch] %(message)s", stream=sys.stderr)
    try:
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1. Received: --workers {args.workers}")
        if args.ps < 0:
            raise ValueError(f"--ps must be >= 0. Received: --ps {args.ps}. Fix: omit --ps "
                             f"for a worker-only cluster, or pass e.g. --ps 1.")
        cpus = parse_cpus(args.cpus, args.workers) if args.cpus is not None else None
        schedule = parse_schedule(args.schedule) if args.schedule is not None else None
        preempt = parse_preemptions(args.preempt) if args.preempt is not None else None
        result = launch([args.script, *args.script_args], args.workers, cpus=cpus,
                        schedule=schedule, max_restarts=args.max_restarts,
                        cap_method=args.cap_method, period_ms=args.period_ms,
                        timeout=args.timeout, threads=args.threads, grace=args.grace,
                        num_ps=args.ps, preempt=preempt, gpus=args.gpus)
    except (ValueError, TypeError, RuntimeError) as e:
        parser.error(str(e))  # Exits with status 2.
    print(f"[launch] {result.message}", file=sys.stderr, flush=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
