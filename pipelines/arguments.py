"""The resilient-training pipeline's arguments, checked before a run or a schedule is created.

A KFP server (and an Argo CronWorkflow) accepts any value of the right type: ``nodes=-1``,
``launcher=bogus``, ``faults=garbage`` or a claim name with capitals would each be found by a step
of the run minutes (or, scheduled, nights) later. This builds what the steps would build from the
same values (the storage request, the trainer config, the cluster job, the gate's settings), with
nothing looked up or created, so each mistake is refused with the step's own message first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resilient_training.run.paths import has_control

PIPELINE_NAME = "resilient-training"
# What the pipeline passes that is not a parameter (pipelines/resilient_training.py).
MOUNT_PATH = "/mnt/run"
# A run id of the shape a KFP server gives (a UUID): names derived from it have their real length.
PLACEHOLDER_RUN_ID = "00000000-0000-0000-0000-000000000000"


def check(values: Mapping[str, Any]) -> None:
    """Refuse arguments the run's steps would refuse.

    Args:
        values: every parameter of the pipeline, defaults filled in (typed: ints, bools, dicts).

    Raises:
        ValueError: one line naming the parameter and what is wrong with it.

    """
    from resilient_training.gates.convergence import ConvergenceConfig
    from resilient_training.gates.export import FORMATS
    from resilient_training.launch import backends, jobshape
    from resilient_training.run import faults as flt
    from resilient_training.storage import provision

    storage, launcher = values["storage"], values["launcher"]
    for name in ("storage", "launcher", "namespace", "pvc_name", "trainer_image", "task", "promote_to", "export",
                 "local_root", "fsx_file_system_id", "fsx_subnet_id", "fsx_security_group_ids", "region"):
        if has_control(str(values[name])):
            raise ValueError(f"{name} {values[name]!r} contains a control character (a newline?)")
    if launcher not in backends.LAUNCHERS:  # before the storage: its message names the launcher
        raise ValueError(f"launcher must be one of {', '.join(backends.LAUNCHERS)}, got {launcher!r}")
    request = provision.provision_request(
        backend=storage, run_id=PLACEHOLDER_RUN_ID, namespace=values["namespace"] or "default",
        mount_path=MOUNT_PATH, local_root=values["local_root"], pvc_name=values["pvc_name"],
        fsx_file_system_id=values["fsx_file_system_id"], fsx_subnet_id=values["fsx_subnet_id"],
        fsx_security_group_ids=values["fsx_security_group_ids"], fsx_capacity_gib=values["fsx_capacity_gib"],
        fsx_deployment_type=values["fsx_deployment_type"], region=values["region"],
    )
    ref = provision.planned_ref(request)
    train = dict(values["train_overrides"] or {})
    train.update(steps=values["steps"], checkpoint_every=values["checkpoint_every"], faults=values["faults"],
                 async_checkpoint=values["async_checkpoint"], inprocess=values["inprocess"],
                 ft_launcher=values["ft_launcher"])
    if values["task"]:
        train["task"] = values["task"]
    if values["task_args"]:
        train["task_args"] = values["task_args"]
    try:
        config = backends.train_config_for(ref, train)
    except ValueError as exc:
        raise ValueError(str(exc)) from None  # its message names the setting
    spec = backends.job_spec_for(
        ref, run_id=PLACEHOLDER_RUN_ID, launcher=launcher, config=config, nodes=values["nodes"],
        gpus_per_node=values["gpus_per_node"], procs_per_node=values["procs_per_node"], image=values["trainer_image"],
    )
    if spec is None:  # local: the cluster job checked these and the schedule against its world; here the local one
        if not 1 <= values["nodes"] <= jobshape.MAX_NODES:  # unused by local, but never meant as written
            raise ValueError(f"nodes must be an integer from 1 to {jobshape.MAX_NODES}, got {values['nodes']}")
        if not 0 <= values["gpus_per_node"] <= 64:
            raise ValueError(f"gpus_per_node must be between 0 and 64, got {values['gpus_per_node']}")
        if values["procs_per_node"] < 0:
            raise ValueError(f"procs_per_node must be >= 0 (0: 2 local workers), got {values['procs_per_node']}")
        text = config.faults.strip()
        if text and not text.endswith((".yaml", ".yml")):
            try:
                flt.validate(flt.parse(text), world_size=values["procs_per_node"] or 2, steps=config.steps,
                             async_checkpoint=config.checkpoint.async_save, checkpoint_every=config.checkpoint.every,
                             local_checkpoint_every=config.checkpoint.local_every)
            except flt.FaultSpecError as exc:
                raise ValueError(f"faults: {exc}") from None
    max_final_loss = values["max_final_loss"]
    ConvergenceConfig(max_final_loss=None if max_final_loss < 0 else max_final_loss,
                      min_improvement=values["min_improvement"])
    if values["export"].strip() not in ("", *FORMATS):
        raise ValueError(f"export {values['export']!r}: choose one of {', '.join(FORMATS)} (or empty for none)")
    if not values["promote_to"].strip():
        raise ValueError("promote_to must name a directory or s3://bucket/prefix, got an empty string")
