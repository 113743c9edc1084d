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
