"""Defaults shared by the pipelines and the local CLI (`run`, `bench`), without importing kfp."""

# 3 faults handled by 2 restart layers in a 40-step CPU run: a worker killed (ft_launcher
# restarts all workers), an exception (in-process restart) and a hang (in-process, after the
# collective timeout).
# The training task (the built-in GPT on synthetic tokens) and its settings (--task-arg).
TASK = "resilient_training.tasks.gpt:task"
TASK_ARGS: dict[str, str] = {}
# promote_model's export: "" (the promoted DCP checkpoint only), safetensors, torch or hf.
EXPORT = ""

RUN_STEPS = 40
RUN_CHECKPOINT_EVERY = 5
RUN_FAULTS = "sigkill@12:1,exception@22:0,hang@33:1"

BENCH_STEPS = 30
BENCH_CHECKPOINT_EVERY = 5
BENCH_FAULTS = "exception@8:0,sigkill@16:1,exception@24:1"

# Retry policies of the steps that are idempotent and meet transient failures (cloud API
# throttling in provision/teardown, a Kubernetes or KFP API blip while launch watches its job: the
# retried launch re-attaches to the running job). (retries, first backoff, factor, max duration).
# Argo counts the max duration from the FIRST attempt's start, so it must cover the longest
# attempt plus the backoffs, or a step that fails late is never retried.
# provision: FSx creation waits up to 30 min + 5 min for the claim to bind, per attempt.
PROVISION_RETRY = (3, "60s", 2.0, "10800s")
# teardown: an FSx file system still CREATING is retried for up to 30 min per attempt.
TEARDOWN_RETRY = (3, "60s", 2.0, "10800s")
# launch: the job's own limit (launch_training timeout_seconds, 24 h) plus 2 h of margin.
LAUNCH_RETRY = (2, "60s", 2.0, "93600s")

# Said in the compiled pipeline's description and by `submit`/`schedule`.
CACHING_NOTE = ("Caching is off for every step: each one has side effects (storage, a training job, gate "
                "records, promotion, the report), so a run is never served from an earlier run's cache.")
