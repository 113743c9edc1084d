"""The resilient-training (and recovery-benchmark) pipeline's arguments, checked before a run or a schedule is created.

A KFP server (and an Argo CronWorkflow) accepts any value of the right type: ``nodes=-1``,
``launcher=bogus``, ``faults=garbage`` or a claim name with capitals would each be found by a step
of the run minutes (or, scheduled, nights) later. This builds what the steps would build from the
same values (the storage request, the trainer config, the cluster job, the gate's settings), with
nothing looked up or created, so each mistake is refused with the step's own message first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from resilient_training.run.paths import has_control

PIPELINE_NAME = "resilient-training"
BENCHMARK_NAME = "recovery-benchmark"
# Settings the pipeline sets from its own parameters: the same name in train_overrides would be
# overwritten without a word (launch_training's component), so it is refused instead.
FROM_PARAMETERS = {"steps": "steps", "checkpoint_every": "checkpoint_every", "faults": "faults",
                   "async_checkpoint": "async_checkpoint", "inprocess": "inprocess", "ft_launcher": "ft_launcher",
                   "task": "task", "task_args": "task_args", "task_arg": "task_args", "export_format": "export"}
NESTED_FROM_PARAMETERS = {("checkpoint", "every"): "checkpoint_every", ("checkpoint", "async_save"): "async_checkpoint",
                          ("restart", "inprocess"): "inprocess", ("restart", "ft_launcher"): "ft_launcher"}
# What the steps' validators call a setting, and the parameter a user gives it as.
_PARAMETER_NAMES = (("subnet_id", "fsx_subnet_id"), ("file system id", "fsx_file_system_id"),
                    ("capacity_gib", "fsx_capacity_gib"), ("deployment_type", "fsx_deployment_type"),
                    ("PERSISTENT_2 needs per_unit_throughput",
                     "fsx_deployment_type PERSISTENT_2 needs fsx_per_unit_throughput"),
                    ("per_unit_throughput", "fsx_per_unit_throughput"),
                    ("image ", "trainer_image "), ("security group", "fsx_security_group_ids: security group"))
# What the pipeline passes that is not a parameter (pipelines/resilient_training.py).
MOUNT_PATH = "/mnt/run"
# A run id of the shape a KFP server gives (a UUID): names derived from it have their real length.
PLACEHOLDER_RUN_ID = "00000000-0000-0000-0000-000000000000"


def check(values: Mapping[str, Any], *, cluster: bool = False, recurring: bool = False,
          local_launcher: bool = True) -> None:
    """Refuse arguments the run's steps would refuse.

    Args:
        values: every parameter of the pipeline, defaults filled in (typed: ints, bools, dicts).
        cluster: the run goes to a KFP server or Argo, where every step runs in a pod of its own.
        recurring: the values are a schedule's (KFP recurring run, Argo CronWorkflow): every run gets
            them, so ``promote_to`` must hold ``{run_id}`` (a fixed place holds the first run's model,
            and promote refuses every later one).
        local_launcher: with ``cluster``, whether ``launcher=local`` may run (ft_launcher inside the step's
            own pod): not on a KFP server, whose components image has no torch or NVRx.

    Raises:
        ValueError: one line naming the parameter and what is wrong with it.

    """
    _renamed(_check, values, cluster=cluster, recurring=recurring, local_launcher=local_launcher)


def check_in_run(values: Mapping[str, Any], *, benchmark: bool = False) -> None:
    """The pipeline's first step: :func:`check` (``benchmark``: :func:`check_benchmark`) on the
    values the run was given, wherever it was made.

    A run made in the KFP UI, through the API or with ``argo submit -p`` was checked by nothing of
    ours; this step refuses it before storage is provisioned. In a pod (a KFP server, Argo) the run
    is on a cluster; ``launcher=local`` can run only where this step's image holds torch and NVRx,
    and the later steps that run in the same image (the components image) need what they import:
    torch to read the checkpoint (validate-checkpoint), and the export format's libraries
    (promote-model). Not checked here: whether the run is a schedule's (``promote_to`` without
    ``{run_id}``), which only the command that made the schedule knows.

    Raises:
        ValueError: one line naming the parameter and what is wrong with it.

    """
    import importlib.util
    import os

    local_launcher = all(importlib.util.find_spec(name) for name in ("torch", "nvidia_resiliency_ext"))
    cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    if benchmark:
        check_benchmark(values, cluster=cluster, local_launcher=local_launcher)
    else:
        check(values, cluster=cluster, local_launcher=local_launcher)
        if cluster:
            _check_components_image(values["export"].strip())


def _check_components_image(export: str) -> None:
    """Refuse a run whose later steps would fail on an import, after training: they run in this
    step's image. (A stranger trial's export=safetensors trained, promoted, then failed.)
    """
    import importlib.util

    from resilient_training.gates.export import MODULES

    needs = {"torch": "validate-checkpoint reads the checkpoint with it"}
    for module in MODULES.get(export, ()):
        needs.setdefault(module, f"promote-model's export {export!r} writes with it")
    missing = {m: why for m, why in needs.items() if importlib.util.find_spec(m) is None}
    if missing:
        raise ValueError(f"the components image has no {', '.join(missing)} ({'; '.join(missing.values())}): "
                         "build it with --build-arg EXTRA_PACKAGES (images/components/Dockerfile) and compile "
                         "with RT_COMPONENTS_IMAGE naming it")


def check_step(values: Mapping[str, Any], *, benchmark: bool = False) -> None:
    """The check step's body: a refused value ends the step with exit 2 and one ``error:`` line,
    the whole of what a KFP or Argo user reads in the failed step's log (no traceback).
    """
    import sys
    import warnings

    # torch.cuda imports pynvml, which warns about its own deprecation: two lines before the one
    # this step prints (a stranger trial), as the CLI filters it too.
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
    try:
        check_in_run(values, benchmark=benchmark)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (TypeError, AttributeError, KeyError) as exc:  # a caller past KFP's and Argo's typed inputs
        print(f"error: a parameter is missing or has a value of the wrong type ({type(exc).__name__}: {exc})"[:500],
              file=sys.stderr)
        raise SystemExit(2) from None


def check_benchmark(values: Mapping[str, Any], *, cluster: bool = False, local_launcher: bool = True) -> None:
    """Refuse recovery-benchmark arguments its steps would refuse, by the same rules as :func:`check`
    (each strategy's training as ``run_strategies`` would build it); the benchmark has no gates.

    Raises:
        ValueError: one line naming the parameter (or the strategy) and what is wrong with it.

    """
    _renamed(_check_benchmark, values, cluster=cluster, local_launcher=local_launcher)


def check_convergence_step(values: Mapping[str, Any]) -> None:
    """The convergence gate step's own arguments (its inputs, defaults filled in) as the gate would refuse
    them, and a run (or reference) directory that is not there, before the step runs.

    Raises:
        ValueError: one line naming the input.

    """
    from pathlib import Path

    from resilient_training.gates.convergence import ConvergenceConfig

    max_final_loss = values["max_final_loss"]
    ConvergenceConfig(
        max_final_loss=None if max_final_loss < 0 else max_final_loss, min_improvement=values["min_improvement"],
        window=values["window"], continuity_rtol=values["continuity_rtol"], jump_rtol=values["jump_rtol"],
        reference_rtol=values["reference_rtol"],
    )
    for key in ("run_dir", "reference_run_dir"):
        if values.get(key) and not Path(values[key]).is_dir():
            raise ValueError(f"{key} {values[key]!r} is not a directory (the run's directory on its storage)")


def _renamed(checker: Any, values: Mapping[str, Any], **kwargs: Any) -> None:
    """Run ``checker``; a step validator's field name in its message becomes the parameter's name."""
    try:
        checker(values, **kwargs)
    except ValueError as exc:
        message = str(exc)
        for field, parameter in _PARAMETER_NAMES:
            if message.startswith(field):
                message = parameter + message[len(field):]
                break
        raise ValueError(message) from None


def _check(values: Mapping[str, Any], *, cluster: bool, recurring: bool, local_launcher: bool) -> None:
    from resilient_training.gates.convergence import ConvergenceConfig, check_reachable
    from resilient_training.gates.export import FORMATS

    _check_text(values, ("promote_to", "export"))
    _check_overrides(values)
    ref = _storage_ref(values)
    train = dict(values["train_overrides"] or {})
    train.update(steps=values["steps"], checkpoint_every=values["checkpoint_every"], faults=values["faults"],
                 async_checkpoint=values["async_checkpoint"], inprocess=values["inprocess"],
                 ft_launcher=values["ft_launcher"])
    if values["task"]:
        train["task"] = values["task"]
    if values["task_args"]:
        train["task_args"] = values["task_args"]
    if str(values.get("export", "")).strip() in FORMATS:  # (any other is refused below, by its parameter's name)
        train["export_format"] = values["export"].strip()
    config = _check_training(values, ref, train, cluster=cluster)
    max_final_loss = values["max_final_loss"]
    check_reachable(config.steps, ConvergenceConfig(max_final_loss=None if max_final_loss < 0 else max_final_loss,
                                                    min_improvement=values["min_improvement"]))
    export = values["export"].strip()
    if export not in ("", *FORMATS):
        raise ValueError(f"export {values['export']!r}: choose one of {', '.join(FORMATS)} (or empty for none)")
    from resilient_training.run.config import DEFAULT_TASK

    if export == "hf" and config.task == DEFAULT_TASK:
        raise ValueError("export 'hf' writes a transformers model, and the built-in GPT task's is not one: "
                         "use safetensors or torch, or a transformers task")
    if export == "hf" and not cluster:  # (on a cluster the task is the trainer image's, not importable here)
        from resilient_training.gates.export import hf_export_problem

        if problem := hf_export_problem(config.task, config.task_args):
            raise ValueError(f"export 'hf': {problem}")
    _check_scheduled_claim(values, recurring=recurring)
    _check_promote_to(values["promote_to"], ref, recurring=recurring,
                      deleted_after=_deleted_file_system(values))
    _check_local_root(values, cluster=cluster)
    _check_on_a_cluster(values, cluster=cluster, local_launcher=local_launcher)


def _check_overrides(values: Mapping[str, Any]) -> None:
    """Refuse a ``train_overrides`` setting that one of the pipeline's parameters (the keys of
    ``values``: each pipeline has its own) overwrites.
    """
    overrides = values["train_overrides"] or {}
    for key in overrides:
        if FROM_PARAMETERS.get(key) in values:
            raise ValueError(f"train_overrides sets {key!r}, which the pipeline's {FROM_PARAMETERS[key]} parameter "
                             f"overwrites: give it as {FROM_PARAMETERS[key]}=...")
    for (group, key), parameter in NESTED_FROM_PARAMETERS.items():
        if parameter in values and isinstance(overrides.get(group), dict) and key in overrides[group]:
            raise ValueError(f"train_overrides sets {group}.{key}, which the pipeline's {parameter} parameter "
                             f"overwrites: give it as {parameter}=...")


def _check_benchmark(values: Mapping[str, Any], *, cluster: bool, local_launcher: bool) -> None:
    from resilient_training.bench.strategy import parse_strategy

    _check_text(values, ())
    _check_overrides(values)  # (a stranger trial's train_overrides {"steps": 1000} ran 30 steps without a word)
    strategies = values["strategies"]
    if not strategies:
        raise ValueError("strategies is empty: give at least one {\"name\": ...} (the default runs four)")
    names = []
    for strategy in strategies:
        if not isinstance(strategy, dict):
            raise ValueError(f"strategies: each strategy is a JSON object with a \"name\", got {strategy!r}")
        try:
            names.append(parse_strategy(strategy)[0])
        except ValueError as exc:
            raise ValueError(f"strategies: {exc}") from None
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"strategies: names must be unique (each names a directory): {', '.join(repeated)}")
    ref = _storage_ref(values)
    # What run_strategies trains: the shared settings, then the strategy's own (which win).
    shared = {**(values["train_overrides"] or {}), "steps": values["steps"],
              "checkpoint_every": values["checkpoint_every"], "faults": values["faults"]}
    if values["task"]:
        shared["task"] = values["task"]
    if values["task_args"]:
        shared["task_args"] = values["task_args"]
    for name, strategy in zip(names, strategies, strict=True):
        try:
            _check_training(values, ref, {**shared, **parse_strategy(strategy)[1]}, cluster=cluster)
        except ValueError as exc:
            raise ValueError(f"strategy {name}: {exc}") from None
    _check_local_root(values, cluster=cluster)
    _check_on_a_cluster(values, cluster=cluster, local_launcher=local_launcher)


_TEXT_PARAMETERS = ("storage", "launcher", "namespace", "pvc_name", "trainer_image", "service_account", "task",
                    "local_root", "fsx_file_system_id", "fsx_subnet_id", "fsx_security_group_ids", "region")


def _check_text(values: Mapping[str, Any], extra: tuple[str, ...]) -> None:
    from resilient_training.launch import backends

    for name in (*_TEXT_PARAMETERS, *extra):
        if has_control(str(values.get(name, ""))):
            raise ValueError(f"{name} {values[name]!r} contains a control character (a newline?)")
    if values["launcher"] not in backends.LAUNCHERS:  # before the storage: its message names the launcher
        raise ValueError(f"launcher must be one of {', '.join(backends.LAUNCHERS)}, got {values['launcher']!r}")


def _storage_ref(values: Mapping[str, Any]) -> Any:
    """The storage the provision step would make, planned (nothing looked up or created)."""
    from resilient_training.storage import provision

    if values["region"] and values["fsx_file_system_id"]:  # reused: no FsxRequest checks it, the clients need it
        from resilient_training.storage import fsx

        fsx.check_region(values["region"])
    # The benchmark passes no FSx sizing: the provision step's own defaults apply.
    sizing = {name: values[name] for name in ("fsx_capacity_gib", "fsx_deployment_type", "fsx_per_unit_throughput")
              if name in values}
    request = provision.provision_request(
        backend=values["storage"], run_id=PLACEHOLDER_RUN_ID, namespace=values["namespace"] or "default",
        mount_path=MOUNT_PATH, local_root=values["local_root"], pvc_name=values["pvc_name"],
        fsx_file_system_id=values["fsx_file_system_id"], fsx_subnet_id=values["fsx_subnet_id"],
        fsx_security_group_ids=values["fsx_security_group_ids"], region=values["region"], **sizing,
    )
    return provision.planned_ref(request)


def _check_training(values: Mapping[str, Any], ref: Any, train: dict[str, Any], *, cluster: bool) -> Any:
    """The trainer config and the cluster job the launch step would build from ``train``; returns the config."""
    import importlib.util
    from pathlib import Path

    from resilient_training.launch import backends, jobshape
    from resilient_training.launch import local as launch_local
    from resilient_training.run import config as cfg
    from resilient_training.run import faults as flt

    launcher = values["launcher"]
    try:
        config = backends.train_config_for(ref, train)
    except ValueError as exc:
        raise ValueError(str(exc)) from None  # its message names the setting
    if config.restart.min_world_size > 0 and launcher == "local" and config.restart.min_world_size > (
            values["procs_per_node"] or 2):
        raise ValueError(f"min_world_size {config.restart.min_world_size} exceeds the world size "
                         f"{values['procs_per_node'] or 2} (procs_per_node, launcher=local)")
    if given := cfg.builtin_task_flags(config):  # in train_overrides: ignored by another task
        raise ValueError(f"train_overrides {', '.join(g.removeprefix('--').replace('-', '_') for g in given)}: the "
                         f"built-in task's settings, which task {config.task} never reads: put what it takes in "
                         "task_args")
    try:
        launch_local.check_shipped_task(config)
    except launch_local.LaunchError as exc:
        raise ValueError(f"task_args: {exc}") from None
    spec = backends.job_spec_for(
        ref, run_id=PLACEHOLDER_RUN_ID, launcher=launcher, config=config, nodes=values["nodes"],
        gpus_per_node=values["gpus_per_node"], procs_per_node=values["procs_per_node"], image=values["trainer_image"],
        service_account=values.get("service_account", ""), efa_per_node=values.get("efa_per_node", 0),
        node_selector=values.get("node_selector") or None, tolerations=values.get("tolerations") or None,
        cpu=values.get("cpu", ""), memory=values.get("memory", ""),
        shm_size=values.get("shm_size", jobshape.DEFAULT_SHM_SIZE),
    )
    if spec is None:  # local: the cluster job checked these and the schedule against its world; here the local one
        if not 1 <= values["nodes"] <= jobshape.MAX_NODES:  # unused by local, but never meant as written
            raise ValueError(f"nodes must be an integer from 1 to {jobshape.MAX_NODES}, got {values['nodes']}")
        if not 0 <= values["gpus_per_node"] <= 64:
            raise ValueError(f"gpus_per_node must be between 0 and 64, got {values['gpus_per_node']}")
        if values["procs_per_node"] < 0:
            raise ValueError(f"procs_per_node must be >= 0 (0: 2 local workers), got {values['procs_per_node']}")
        if values["procs_per_node"] > launch_local.max_local_procs():
            raise ValueError(f"procs_per_node {values['procs_per_node']} is more local workers than this machine can "
                             f"run (at most {launch_local.max_local_procs()}, 8 per CPU)")
        # Worker pods' placement, which local training (no pods) would drop without a word (stranger trial).
        for name in ("efa_per_node", "node_selector", "tolerations", "cpu", "memory", "shm_size"):
            if values.get(name) and values[name] != (jobshape.DEFAULT_SHM_SIZE if name == "shm_size" else None):
                raise ValueError(f"{name} places the worker pods of launcher=pytorchjob or trainjob; launcher "
                                 f"'local' starts none and would ignore it")
        text = config.faults.strip()
        is_file = text.endswith((".yaml", ".yml")) or "/" in text
        # A schedule file is read where the launch step runs: this machine too, unless this step
        # runs in a pod of its own (launcher=local on a cluster), which has not the launch pod's files.
        if text and not (is_file and cluster):
            try:
                flt.validate(flt.parse(text), world_size=values["procs_per_node"] or 2, steps=config.steps,
                             async_checkpoint=config.checkpoint.async_save, checkpoint_every=config.checkpoint.every,
                             local_checkpoint_every=config.checkpoint.local_every)
            except flt.FaultSpecError as exc:
                relative = is_file and not Path(text).is_absolute()
                where = f" (relative to {Path.cwd()}, where the steps run)" if relative else ""
                raise ValueError(f"faults: {exc}{where}") from None
        # The task is imported where the launch step runs: here too, unless this step has a pod of
        # its own. `run --task` refused a module that does not import; the step let it through
        # to the training (a stranger trial).
        if not cluster and importlib.util.find_spec("torch") is not None:
            try:
                launch_local.check_task(config, world_size=values["procs_per_node"] or 2)
            except launch_local.LaunchError as exc:
                raise ValueError(f"task: {exc}") from None
    return config


def _check_local_root(values: Mapping[str, Any], *, cluster: bool) -> None:
    """storage=local with every step on this machine: ``local_root`` must be able to be a directory
    (a stranger trial's local_root=/etc/passwd passed, then provisioning raised NotADirectoryError).
    On a cluster storage=local is refused as such (:func:`_check_on_a_cluster`).
    """
    from resilient_training.run.paths import check_writable

    if not cluster and values["storage"] == "local":
        check_writable(os.path.expanduser(values["local_root"]), "local_root", directory=True)


def _check_on_a_cluster(values: Mapping[str, Any], *, cluster: bool, local_launcher: bool) -> None:
    """Last: a value the user typed is named before a default that cannot run on a cluster."""
    from resilient_training.launch import jobshape

    if cluster and values["storage"] == "local":
        raise ValueError("storage 'local' is a directory on one machine, but on a cluster every step runs in a pod "
                         "of its own: use storage=pvc (with pvc_name) or fsx; local is for `resilient-training run`")
    if cluster and not local_launcher and values["launcher"] == "local":
        raise ValueError(f"launcher 'local' would train inside the launch step's own pod (the components image, no "
                         f"torch or NVRx): on a cluster use launcher={' or '.join(jobshape.KINDS)}; local is for "
                         "`resilient-training run`")


def _check_scheduled_claim(values: Mapping[str, Any], *, recurring: bool) -> None:
    """storage=fsx makes a claim named ``pvc_name``: on a schedule every run would make the same one.
    The second of two overlapping runs (or the run after one whose teardown failed) finds it taken
    and fails; empty names each run's claim from its run id. (A claim name takes no ``{run_id}``: it
    is a DNS-1123 name, checked as such.)
    """
    if recurring and values["storage"] == "fsx" and values["pvc_name"]:
        raise ValueError(f"pvc_name {values['pvc_name']!r} is the claim every scheduled run would create "
                         "(storage=fsx): a run that overlaps another, or follows one whose teardown failed, finds it "
                         "taken and fails; leave pvc_name empty (each run's claim is then named from its run id)")


def _deleted_file_system(values: Mapping[str, Any]) -> bool:
    """Whether the run's claim goes with the run: storage=fsx makes a file system for the run (none
    is reused) and the exit handler deletes it (delete_file_system, the default).
    """
    return (values["storage"] == "fsx" and not values["fsx_file_system_id"]
            and bool(values.get("delete_file_system", True)))


def _check_promote_to(dest: str, ref: Any, *, recurring: bool, deleted_after: bool = False) -> None:
    """What the promote step refuses about DEST's spelling, and, on shared storage, what loses the
    model or cannot work: a relative path (the step pod's own disk), the run's claim around the run,
    a place inside the run, any path when the claim's file system is deleted after the run
    (``deleted_after``); on a schedule, a DEST without ``{run_id}`` (taken after the first run).
    """
    from resilient_training.gates.promote import RUN_ID_FIELD, check_dest_text

    try:
        check_dest_text(dest)
    except ValueError as exc:
        raise ValueError(f"promote_to: {exc}") from None
    if not dest.startswith("s3://") and ref.shared and deleted_after:
        # The same loss as a relative path's, minutes later: teardown deletes PVC, PV and file system.
        raise ValueError(f"promote_to {dest!r} is not in S3, and with storage=fsx the run's file system (the claim "
                         f"at {ref.mount_path}) is deleted when the run ends, the promoted model with it: promote to "
                         "s3://bucket/prefix, or keep the file system (delete_file_system=false)")
    if not dest.startswith("s3://") and ref.shared:
        _check_promote_path(dest, ref)
    elif not dest.startswith("s3://") and ref.backend == "local":
        _check_local_promote(dest, ref)
    if recurring and RUN_ID_FIELD not in dest:
        raise ValueError(f"promote_to {dest!r} is the same place for every scheduled run: the first run's model "
                         f"takes it and promotion refuses every later one; put {RUN_ID_FIELD} in it (the run's id), "
                         f"e.g. {dest.rstrip('/')}/{RUN_ID_FIELD}")


def _check_promote_path(dest: str, ref: Any) -> None:
    from pathlib import PurePosixPath

    from resilient_training.gates.promote import RUN_ID_FIELD

    path = PurePosixPath(dest)
    if not path.is_absolute():
        raise ValueError(f"promote_to {dest!r} is relative: on a cluster it lands on the promote step's own pod "
                         f"and is lost with it; give s3://bucket/prefix or a path on the claim under {ref.mount_path}")
    mount = PurePosixPath(ref.mount_path)
    if ".." not in path.parts and path != mount and mount not in path.parents:
        raise ValueError(f"promote_to {dest!r} is not on the run's claim ({ref.mount_path}): it lands on the promote "
                         f"step's own pod and is lost with it; give s3://bucket/prefix or a path under "
                         f"{ref.mount_path}")
    run_dir = PurePosixPath(ref.run_dir)
    if ".." in path.parts or path == PurePosixPath("/") or path in run_dir.parents:
        raise ValueError(f"promote_to {dest!r} contains the run directory ({run_dir.parent}/<run id>) or is not a "
                         f"plain path: promote to a directory beside it, e.g. {ref.mount_path}/promoted")
    expanded = PurePosixPath(dest.replace(RUN_ID_FIELD, run_dir.name))
    # The claim's file system is not here to ask (pathconf): Linux's, FSx for Lustre's included, is 255 bytes.
    if long := next((part for part in expanded.parts if len(part.encode()) > 255), None):
        raise ValueError(f"promote_to {dest!r} has a name of {len(long.encode())} bytes ({long[:20]}...), longer than "
                         "the 255 a Linux file system allows")
    runs = run_dir.parent
    if runs in expanded.parents and not (expanded == run_dir or run_dir in expanded.parents):
        raise ValueError(f"promote_to {dest!r} is inside {runs}, where each run gets its directory (another "
                         f"run's, or one a later run takes): promote beside it, e.g. {ref.mount_path}/promoted/"
                         f"{RUN_ID_FIELD}")
    if expanded == run_dir or run_dir in expanded.parents:
        raise ValueError(f"promote_to {dest!r} is inside the run directory ({run_dir.parent}/<run id>), which "
                         f"promotion refuses: promote beside it, e.g. {ref.mount_path}/promoted/{RUN_ID_FIELD}")


def _check_local_promote(dest: str, ref: Any) -> None:
    """storage=local (kfp.local, `resilient-training run`): every step runs on this machine, in this
    step's working directory, so DEST resolves here as the promote step will resolve it. In or
    around the directory that gets each run's directory (``local_root``/runs), promotion refuses it
    (inside the run) or finds it not empty, after the training: refused now, as `run` refuses it.
    """
    from pathlib import Path

    from resilient_training.gates.promote import RUN_ID_FIELD

    runs = Path(ref.run_dir).expanduser().resolve().parent
    sample = Path(dest.replace(RUN_ID_FIELD, "run")).resolve()
    if sample == runs or runs in sample.parents or sample in runs.parents:
        raise ValueError(f"promote_to {dest!r} is inside or around {runs}, where each run gets its directory "
                         f"(local_root/runs; promotion refuses a place in its own run): promote beside it, "
                         f"e.g. {runs.parent}/promoted")
