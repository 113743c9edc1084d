"""``resilient-training render-job``: write the PyTorchJob (or, with ``--kind trainjob``, the
Kubeflow Trainer v2 TrainJob) YAML for ``kubectl apply``.

Takes the job's shape (nodes, GPUs, image, storage claim, scheduling) and every trainer flag of
``resilient-training train`` (``--steps``, ``--faults``, ``--no-inprocess``, ...). An invalid
name, count or path exits with status 2 and the reason, before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, once: not after a help text that gives its own (the trainer flags do), nor an empty one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default in (None, "", [], argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


def register(subparsers: Any) -> None:
    from resilient_training.launch import images, jobshape, trainjob
    from resilient_training.run import config

    p = subparsers.add_parser(
        "render-job",
        help="write a Kubeflow PyTorchJob or TrainJob (ft_launcher on every node) as YAML",
        description=__doc__,
        formatter_class=_DefaultsFormatter,
    )
    job = p.add_argument_group("job")
    job.add_argument("--kind", choices=jobshape.KINDS, default="pytorchjob",
                     help="pytorchjob (Training Operator v1) or trainjob (Kubeflow Trainer v2)")
    job.add_argument("--runtime", default=trainjob.RUNTIME_NAME,
                     help="trainjob: the ClusterTrainingRuntime it names (manifests/runtimes)")
    job.add_argument("--name", required=True, help="job name (DNS-1035; pods are NAME-worker-I or NAME-node-0-I)")
    job.add_argument("--namespace", default="default", help="namespace of the job and the claim")
    job.add_argument("--nodes", type=int, required=True, help="worker pods, one per node (the maximum if --min-nodes)")
    job.add_argument("--min-nodes", type=int, default=0, help="elastic: fewest nodes to run on (0 = exactly --nodes)")
    job.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per pod (0 for CPU pods)")
    job.add_argument("--procs-per-node", type=int, default=0, help="processes per pod (0 = one per GPU)")
    job.add_argument("--image", default=images.TRAINER_IMAGE, help="trainer image")
    job.add_argument("--efa", type=int, default=0, help="EFA interfaces per pod")
    job.add_argument("--cpu", default="", help="CPU request/limit per pod")
    job.add_argument("--memory", default="", help="memory request/limit per pod")
    job.add_argument("--shm-size", default="64Gi", help="size limit of /dev/shm")
    job.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    job.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE][:EFFECT]", help="repeatable")
    job.add_argument("--service-account", default=jobshape.TRAINER_SERVICE_ACCOUNT,
                     help="service account of the worker pods (manifests/rbac makes it; '' leaves it to the namespace)")
    job.add_argument("--priority-class", default="", help="pod priority class")
    job.add_argument("--pvc", required=True, help="existing PersistentVolumeClaim (e.g. from provision_storage)")
    job.add_argument("--mount-path", default="/mnt/run", help="where the claim is mounted in the pods")
    job.add_argument("--run-id", default="",
                     help="run id: rendezvous id, label and run directory name; letters, digits, '.', '_', '-' "
                          "(at most 63; default: the job name)")
    job.add_argument("--nvrx-version", default=jobshape.DEFAULT_NVRX_VERSION, help="NVRx in the image")
    job.add_argument("--backoff-limit", type=int, default=3, help="pod replacements before the job fails")
    job.add_argument("--active-deadline", type=int, default=0, help="job deadline in seconds (0 = none)")
    job.add_argument("--ttl", type=int, default=None,
                     help="pytorchjob: delete the finished job after seconds (0 = keep; default 7 days)")
    job.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra container env")
    job.add_argument("-o", "--output", default="-", help="output file ('-' = stdout)")
    train = p.add_argument_group("trainer (as for `train`); --run-dir defaults to MOUNT/runs/RUN_ID")
    config.add_arguments(train, required_run_dir=False)
    p.set_defaults(func=run)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    from resilient_training.run.paths import has_control

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} {item!r} must be KEY=VALUE")
        if what == "--env" and has_control(value):  # a pasted newline reached the pod's env (stranger trial)
            raise ValueError(f"{what} {item!r}: the value contains a control character (a newline?)")
        if key in out:  # the last one silently winning hides a typo (as a JSON node_selector's repeated key)
            raise ValueError(f"{what} {key!r} is given twice ({key}={out[key]}, {key}={value}): give it once")
        out[key] = value
    return out


def _check_image_variable(image: str) -> None:
    """An --image left at its default from $RT_TRAINER_IMAGE is checked under that name (a stranger trial's
    RT_TRAINER_IMAGE='' gave "image must be ... got ''", naming neither the flag nor the variable).
    """
    from resilient_training.launch import images, jobshape

    if images.TRAINER_ENV in images.from_environment() and image == images.TRAINER_IMAGE:
        jobshape.check_image(image, f"${images.TRAINER_ENV} (the default of --image)")


def build_spec(args: argparse.Namespace) -> Any:
    from resilient_training.launch import jobshape, k8s_names, trainjob
    from resilient_training.run import config
    from resilient_training.run.storage_ref import StorageRef

    k8s_names.check_dns1035_label(args.name, "job name")  # before the run dir is derived from it
    if args.run_id:  # likewise (the job name, a DNS-1035 label, is a good one)
        jobshape.check_run_id(args.run_id, "--run-id")
    _check_image_variable(args.image)
    run_id = args.run_id or args.name
    mount = args.mount_path.rstrip("/") or "/"
    args.run_dir = args.run_dir or f"{mount}/runs/{run_id}"
    storage = StorageRef(backend="pvc", run_dir=args.run_dir, mount_path=args.mount_path,
                         namespace=args.namespace, pvc_name=args.pvc)
    if args.kind == "trainjob" and args.ttl is not None:
        raise ValueError("--ttl: a TrainJob has no TTL (teardown_storage or kubectl delete removes it)")
    if args.kind == "trainjob":
        k8s_names.check_dns1123_subdomain(args.runtime, "--runtime")
    elif args.runtime != trainjob.RUNTIME_NAME:
        raise ValueError("--runtime names a ClusterTrainingRuntime: only with --kind trainjob")
    return jobshape.JobSpec(
        kind=args.kind, name=args.name, namespace=args.namespace, train=config.from_namespace(args), storage=storage,
        image=args.image, nodes=args.nodes, min_nodes=args.min_nodes, gpus_per_node=args.gpus_per_node,
        procs_per_node=args.procs_per_node, efa_per_node=args.efa, cpu=args.cpu, memory=args.memory,
        shm_size=args.shm_size, node_selector=_pairs(args.node_selector, "--node-selector"),
        tolerations=[jobshape.parse_toleration(t) for t in args.toleration],
        service_account=args.service_account, priority_class=args.priority_class, run_id=run_id,
        nvrx_version=args.nvrx_version, backoff_limit=args.backoff_limit,
        active_deadline_seconds=args.active_deadline,
        ttl_seconds_after_finished=7 * 24 * 3600 if args.ttl is None else args.ttl,
        env=_pairs(args.env, "--env"),
    )


def run(args: argparse.Namespace) -> int:
    from resilient_training.launch import pytorchjob, trainjob
    from resilient_training.run.paths import check_writable

    try:
        if args.output != "-":
            check_writable(args.output, "-o", directory=False)
        spec = build_spec(args)
    except ValueError as exc:
        print(f"render-job: {exc}", file=sys.stderr)
        return 2
    if spec.kind == "trainjob":
        text, what = trainjob.to_yaml(trainjob.build_job(spec, runtime=args.runtime)), "TrainJob"
    else:
        text, what = pytorchjob.to_yaml(pytorchjob.build_job(spec)), "PyTorchJob"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        try:  # what the checks cannot foresee (/proc, /dev/full) is one line too
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            with open(args.output, "w") as f:
                f.write(text)
        except OSError as exc:
            print(f"render-job: cannot write -o {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.output}: {what} {spec.namespace}/{spec.name}, {spec.nodes} x {spec.nproc_per_node}",
              file=sys.stderr)
    return 0
