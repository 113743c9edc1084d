"""Each pipeline's first step: its own arguments, checked inside the run.

``submit``, ``schedule`` and ``run`` check a run's arguments before it exists
(:mod:`resilient_training.pipelines.arguments`). A run made in the KFP UI, through the API or with
``argo submit -p`` bypasses them, and a wrong value would surface minutes later in the step that
uses it, after an FSx file system was made. This step runs the same check first: exit 2 and one
``error:`` line in its log, before storage is provisioned.

Steps of the pipelines rather than folders of ``components/``: each takes its pipeline's
parameters (every one, by name), and components do not import the pipeline layer.
"""

# No `from __future__ import annotations`: KFP reads the real annotation objects.
from kfp import dsl

from resilient_training.launch.images import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def check_arguments(
    storage: str,
    launcher: str,
    steps: int,
    checkpoint_every: int,
    faults: str,
    async_checkpoint: bool,
    inprocess: bool,
    ft_launcher: bool,
    train_overrides: dict,
    task: str,
    task_args: dict,
    nodes: int,
    gpus_per_node: int,
    procs_per_node: int,
    trainer_image: str,
    service_account: str,
    efa_per_node: int,
    node_selector: dict,
    tolerations: list,
    cpu: str,
    memory: str,
    shm_size: str,
    namespace: str,
    local_root: str,
    pvc_name: str,
    fsx_file_system_id: str,
    fsx_subnet_id: str,
    fsx_security_group_ids: str,
    fsx_capacity_gib: int,
    fsx_deployment_type: str,
    fsx_per_unit_throughput: int,
    region: str,
    promote_to: str,
    export: str,
    max_final_loss: float,
    min_improvement: float,
    delete_file_system: bool,
):
    """Refuse the run's arguments that a later step would refuse (exit 2, one line), before anything is made.

    Every input is the resilient-training pipeline's parameter of the same name.
    """
    values = dict(locals())  # first: every input by name, nothing else
    from resilient_training.pipelines.arguments import check_step

    check_step(values)


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def check_benchmark_arguments(
    strategies: list[dict],
    steps: int,
    checkpoint_every: int,
    faults: str,
    train_overrides: dict,
    task: str,
    task_args: dict,
    storage: str,
    launcher: str,
    procs_per_node: int,
    nodes: int,
    gpus_per_node: int,
    trainer_image: str,
    service_account: str,
    namespace: str,
    local_root: str,
    pvc_name: str,
    fsx_file_system_id: str,
    fsx_subnet_id: str,
    fsx_security_group_ids: str,
    region: str,
):
    """Refuse the benchmark's arguments that a later step would refuse (exit 2, one line), before anything is made.

    Every input is the recovery-benchmark pipeline's parameter of the same name.
    """
    values = dict(locals())  # first: every input by name, nothing else
    from resilient_training.pipelines.arguments import check_step

    check_step(values, benchmark=True)
