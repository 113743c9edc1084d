"""``resilient-training train``: NVRx-wrapped FSDP training on this machine (one agent or simulated nodes)."""

from __future__ import annotations

import argparse
import sys

from resilient_training.launch import cancel
from resilient_training.launch.local import LaunchError, run_local
from resilient_training.run import config as cfg

# The simulated cluster's flags and the ClusterSpec fields they set.
CLUSTER_FLAGS = (("--min-nodes", "min_nodes"), ("--pod-restart-delay", "pod_restart_delay"), ("--network", "network"),
                 ("--rdzv-last-call", "last_call_timeout"))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train locally under ft_launcher with injected faults",
        description="Run NVRx-wrapped FSDP training on this machine (gloo on CPU) under ft_launcher.",
    )
    parser.add_argument("--nproc", type=int, default=2, help="worker processes (ranks) per node")
    nodes = parser.add_argument_group("simulated cluster (one ft_launcher agent per node, as in a PyTorchJob)")
    nodes.add_argument("--nodes", type=int, default=None,
                       help="simulate N worker pods on this machine (node faults need it); default: one agent")
    # Defaults None: given without --nodes they would be ignored, so they are refused (a stranger
    # trial's --pod-restart-delay nan trained without a word); ClusterSpec holds the defaults.
    nodes.add_argument("--min-nodes", type=int, default=None, help="elastic: fewest nodes to run on (0 = --nodes)")
    nodes.add_argument("--pod-restart-delay", type=float, default=None,
                       help="seconds before a lost pod's replacement starts (default: 2.0)")
    nodes.add_argument("--network", choices=("auto", "netns", "loopback"), default=None,
                       help="a network namespace per node, or loopback (auto: namespaces when possible)")
    nodes.add_argument("--rdzv-last-call", type=float, default=None,
                       help="rendezvous wait for more nodes once --min-nodes joined (default: 5)")
    cfg.add_arguments(parser)
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        config = cfg.from_namespace(args)
        config.task = cfg.absolute_task(config.task)  # the workers may start in another directory
        config.faults = cfg.absolute_faults(config.faults)
        given = {field: value for flag, field in CLUSTER_FLAGS
                 if (value := getattr(args, flag.removeprefix("--").replace("-", "_"))) is not None}
        if args.nodes is None:
            if given:
                flags = [flag for flag, field in CLUSTER_FLAGS if field in given]
                raise LaunchError(f"{', '.join(flags)}: a setting of the simulated cluster, which runs only with "
                                  "--nodes N")
            result = run_local(config, nproc=args.nproc)
        else:
            from resilient_training.launch import simulated_cluster as sim

            spec = sim.ClusterSpec(nodes=args.nodes, nproc_per_node=args.nproc, **given)
            result = sim.run_cluster(config, spec)
    except (LaunchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit) as exc:
        # SIGTERM or Ctrl-C while training: the launcher stopped the workers and logged the run's
        # end; one line, not silence (or, for Ctrl-C, not "interrupted" alone).
        if (stopped := cancel.interruption(exc)) is None:
            raise
        print(f"interrupted ({stopped[0]}): stopped the training and its workers; the same command resumes "
              f"from the last committed checkpoint in {args.run_dir}", file=sys.stderr)
        return stopped[1]
    stream = sys.stdout if result.ok else sys.stderr
    print(("done: " if result.ok else "FAILED: ") + result.reason, file=stream)
    print(f"run directory: {result.run_dir}", file=stream)
    return 0 if result.ok else 1
