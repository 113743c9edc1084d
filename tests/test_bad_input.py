"""The bad-input corpus: every command, fed what an adversarial or careless user types.

Each case must exit 2 with ONE line on stderr naming the problem, no traceback, and nothing
created or changed: the working directory, the run it names and the targets stay as they were.
The CLI runs in process (``resilient_training.cli.main.main``), so a traceback would fail the
test as an exception.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from resilient_training.cli.main import main
from tests.support.gates import ScriptedLog, build_once, write_checkpoint
from tests.support.kfp_api_server import FakeKfpServer

LONG = "x" * 300  # past NAME_MAX (255 on every Linux file system here)
RENDER = ["render-job", "--name", "job", "--nodes", "1", "--gpus-per-node", "1", "--pvc", "claim"]
REGISTRY = "tests.support.kfp_fixture_pipelines:PIPELINES"
HOST = ["--host", "http://127.0.0.1:9"]  # nothing listens: a case that got past the checks would fail with 1


def _yaml(text: str) -> str:
    return "yaml:" + text


CASES: list[tuple[str, list[str], str]] = [
    # --- train: fault schedules as YAML files with wrongly typed fields
    ("yaml-faults-int", ["train", "--run-dir", "r", "--faults", _yaml("faults: 5\n")], "faults must be a list"),
    ("yaml-random-str", ["train", "--run-dir", "r", "--faults", _yaml('random: "abc"\n')],
     "random must be a mapping"),
    ("yaml-step-str", ["train", "--run-dir", "r", "--faults", _yaml("faults:\n  - {type: hang, step: '3', rank: 1}\n")],
     "step must be an integer"),
    ("yaml-rank-bool", ["train", "--run-dir", "r", "--faults", _yaml("faults:\n  - {type: hang, step: 3, rank: true}\n")],
     "rank must be an integer"),
    ("yaml-item-list", ["train", "--run-dir", "r", "--faults", _yaml("faults:\n  - [hang, 3, 1]\n")],
     "needs type, step and rank"),
    ("yaml-random-no-max", ["train", "--run-dir", "r", "--faults", _yaml("random: {count: 2}\n")],
     "with max_step"),
    ("yaml-random-types-str", ["train", "--run-dir", "r", "--faults",
                               _yaml("random: {max_step: 5, types: exception}\n")], "types must be a non-empty list"),
    ("yaml-random-too-many", ["train", "--run-dir", "r", "--faults", _yaml("random: {max_step: 2, count: 9}\n")],
     "do not fit"),
    ("yaml-seed-str", ["train", "--run-dir", "r", "--faults", _yaml("seed: abc\nrandom: {max_step: 5}\n")],
     "seed must be an integer"),
    ("yaml-unknown-key", ["train", "--run-dir", "r", "--faults", _yaml("fault: []\n")], "unknown keys fault"),
    ("load-hang-step-0", ["train", "--run-dir", "r", "--faults", "load-hang@0:1"], "steps start at 1"),
    ("ckpt-hang-not-a-save", ["train", "--run-dir", "r", "--checkpoint-every", "4", "--faults", "ckpt-hang@3:1"],
     "step 3 saves no checkpoint"),
    ("yaml-broken", ["train", "--run-dir", "r", "--faults", _yaml("faults: [\n")], "not valid YAML"),
    ("yaml-is-a-dir", ["train", "--run-dir", "r", "--faults", "{dir}.yaml"], "cannot read fault schedule"),
    # --- train: run directories and settings
    ("train-run-dir-empty", ["train", "--run-dir", ""], "run_dir must not be empty"),
    # found by a stranger trial: accepted, written to config.json, and ignored by the task
    ("train-lr-with-own-task", ["train", "--run-dir", "{work}/r", "--lr", "0.5", "--model-d-model", "32",
                                "--task", "resilient_training.tasks.llama:task"],
     "--model-d-model, --lr are settings of the built-in task, which task resilient_training.tasks.llama:task never"),
    ("run-batch-size-with-own-task", ["run", "--train-overrides", '{"batch_size": 3}',
                                      "--task", "resilient_training.tasks.llama:task"],
     "--batch-size is a setting of the built-in task"),
    ("train-run-dir-blank", ["train", "--run-dir", "  "], "run_dir must not be empty"),
    ("train-run-dir-newline", ["train", "--run-dir", "r\n"], "control character"),
    ("train-run-dir-trailing-space", ["train", "--run-dir", "{work}/r "], "has leading or trailing whitespace"),
    ("run-output-dir-trailing-space", ["run", "--output-dir", "{work}/o "], "has leading or trailing whitespace"),
    ("train-local-dir-trailing-space", ["train", "--run-dir", "{work}/r", "--local-checkpoint-every", "2",
                                        "--local-checkpoint-dir", "{work}/lc "], "has leading or trailing whitespace"),
    ("train-run-dir-under-file", ["train", "--run-dir", "{file}/r"], "is a file, not a directory"),
    ("train-run-dir-is-file", ["train", "--run-dir", "{file}"], "exists and is not a directory"),
    ("train-run-dir-unwritable", ["train", "--run-dir", "{locked}/r"], "is not writable"),
    ("train-run-dir-name-max", ["train", "--run-dir", LONG], "longer than the file system allows"),
    ("train-run-dir-path-max", ["train", "--run-dir", "/".join([LONG[:200]] * 25)], "past the system's limit"),
    # found by a stranger trial: access() says yes to root on /proc, and `train` ended in a traceback
    ("train-run-dir-in-proc", ["train", "--run-dir", "/proc/rt-no-such-run"], "cannot be created or written"),
    ("train-batch-size-0", ["train", "--run-dir", "r", "--batch-size", "0"], "batch_size must be positive"),
    ("train-steps-0", ["train", "--run-dir", "r", "--steps", "0"], "steps must be positive"),
    ("train-lr-nan", ["train", "--run-dir", "r", "--lr", "nan"], "lr must be a finite number"),
    ("train-pg-timeout-inf", ["train", "--run-dir", "r", "--pg-timeout", "inf"], "pg must be a finite number"),
    ("train-heads", ["train", "--run-dir", "r", "--model-n-heads", "3"], "divisible by n_heads"),
    # numbers with surrounding blanks (a value pasted with its newline): int() would take them
    ("train-steps-newline", ["train", "--run-dir", "r", "--steps", "3\n"], "invalid int value: '3\\n'"),
    ("train-threads-spaces", ["train", "--run-dir", "r", "--checkpoint-write-threads", " 3 "], "invalid int value"),
    ("train-lr-newline", ["train", "--run-dir", "r", "--lr", "0.1\n"], "invalid float value"),
    ("check-convergence-window-newline", ["check-convergence", "r", "--window", "5\n"], "invalid int value"),
    # the built-in task with --task-arg is still checked before any worker starts
    ("train-task-arg-not-int", ["train", "--run-dir", "r", "--task-arg", "d_model=abc"],
     "d_model='abc' is not an integer"),
    ("train-task-arg-heads", ["train", "--run-dir", "r", "--task-arg", "n_heads=5"], "divisible by n_heads"),
    # found by a stranger trial: a pasted newline was kept in the value, a repeated key silently won
    ("train-task-arg-newline", ["train", "--run-dir", "r", "--task-arg", "lr=0.02\n"], "control character"),
    ("train-task-arg-key-tab", ["train", "--run-dir", "r", "--task-arg", "l\tr=0.02"], "control character"),
    ("train-task-arg-repeated", ["train", "--run-dir", "r", "--task-arg", "lr=1", "--task-arg", "lr=2"],
     "task argument lr is given twice"),
    ("train-nproc-0", ["train", "--run-dir", "r", "--nproc", "0"], "world size must be at least 1"),
    # a stranger trial's started spawning workers, about 7 a second
    ("train-nproc-huge", ["train", "--run-dir", "r", "--nproc", "100000"], "more workers than this machine"),
    ("run-nproc-huge", ["run", "--output-dir", "o", "--nproc", "100000"], "more workers than this machine"),
    ("train-faults-unicode-digits", ["train", "--run-dir", "r", "--faults", "sigkill@\u0661\u0662:1"],
     "expected TYPE@STEP:RANK"),
    ("train-steps-word", ["train", "--run-dir", "r", "--steps", "many"], "invalid int value"),
    ("train-fault-rank", ["train", "--run-dir", "r", "--faults", "sigkill@3:7"], "rank 7 does not exist"),
    ("train-fault-newline", ["train", "--run-dir", "r", "--faults", "sigkill@3:0\n"], "control character"),
    ("train-local-dir-newline", ["train", "--run-dir", "r", "--local-checkpoint-dir", "/dev/shm/x\ny"],
     "control character"),
    # found by a stranger trial: a file (or /proc) as the node-local tier ended after 40 s of restarts
    ("train-local-dir-unusable", ["train", "--run-dir", "r", "--local-checkpoint-every", "2",
                                  "--local-checkpoint-dir", "/proc/rt-no-such"], "cannot hold the node-local tier"),
    ("train-host-snapshot-alone", ["train", "--run-dir", "r", "--host-snapshot"],
     "host_snapshot needs memory_snapshot_every and local_checkpoint_every"),
    ("train-spare-writer-sync", ["train", "--run-dir", "r", "--spare-writer", "--no-async-checkpoint"],
     "spare_writer needs async checkpointing"),
    ("train-memory-limit-negative", ["train", "--run-dir", "r", "--memory-limit-mb", "-5"],
     "memory_limit_mb must be >= 0"),
    ("train-rdzv-last-call-nan", ["train", "--run-dir", "r", "--nodes", "2", "--rdzv-last-call", "nan"],
     "last_call_timeout must be at least 1"),
    ("train-pod-restart-delay-nan", ["train", "--run-dir", "r", "--nodes", "2", "--pod-restart-delay", "nan"],
     "pod_restart_delay must be >= 0 and finite"),
    # --- run / bench
    ("run-overrides-model-int", ["run", "--train-overrides", '{"model": 5}'], "setting model must be a mapping"),
    ("run-overrides-model-field", ["run", "--train-overrides", '{"model": {"d_model": "big"}}'],
     "d_model must be an integer"),
    ("run-overrides-not-json", ["run", "--train-overrides", "{model: 5}"], "--train-overrides is not valid JSON"),
    ("run-overrides-run-dir", ["run", "--train-overrides", '{"run_dir": "/etc"}'], "cannot set run_dir"),
    # found by a stranger trial: the pipeline's own parameters overwrote these without a word
    ("run-overrides-steps", ["run", "--faults", "", "--train-overrides", '{"steps": 10, "checkpoint_every": 2}'],
     "train_overrides sets 'steps', which the pipeline's steps parameter overwrites: give it as --steps N"),
    # A stranger trial: `run` said "give it as inprocess=...", a parameter it had no flag for (it could not turn
    # in-process restarts off at all).
    ("run-overrides-inprocess", ["run", "--faults", "", "--train-overrides", '{"restart": {"inprocess": false}}'],
     "give it as --inprocess / --no-inprocess"),
    ("run-overrides-checkpoint-every", ["run", "--train-overrides", '{"checkpoint_every": 2}'],
     "train_overrides sets 'checkpoint_every', which the pipeline's checkpoint_every parameter overwrites"),
    ("run-overrides-faults", ["run", "--faults", "", "--steps", "6", "--checkpoint-every", "3", "--train-overrides",
                              '{"faults": "sigkill@3:1"}'], "train_overrides sets 'faults'"),
    # found by a stranger trial: each trained, then failed at promotion
    ("run-export-hf-builtin-task", ["run", "--export", "hf"], "the built-in GPT task's is not one"),
    # third stranger trial: a user's task that is no transformers model trained and promoted first
    ("run-export-hf-user-task", ["run", "--task", f"{Path(__file__).parent / 'support' / 'stranger_task.py'}:task",
                                 "--export", "hf"], "builds a TiedMLP, not a transformers model"),
    # a cluster's workers refuse it from the job's export_format (the task is the trainer image's)
    ("train-export-format-hf-user-task", ["train", "--run-dir", "r", "--task",
                                          f"{Path(__file__).parent / 'support' / 'stranger_task.py'}:task",
                                          "--export-format", "hf"],
     "export_format hf: the run's task ("),
    ("train-export-format-unknown", ["train", "--run-dir", "r", "--export-format", "onnx"],
     "export_format 'onnx': choose one of dcp, torch, safetensors, hf"),
    ("run-overrides-export-format", ["run", "--train-overrides", '{"export_format": "safetensors"}'],
     "train_overrides sets 'export_format', which the pipeline's export parameter overwrites"),
    ("run-promote-to-non-empty", ["run", "--promote-to", "{run}"], "exists and is not an empty directory"),
    ("run-output-proc", ["run", "--output-dir", "/proc/rt-x"], "/proc"),  # root: access() says yes there
    ("run-overrides-lr-nan", ["run", "--train-overrides", '{"lr": NaN}'], "lr must be a finite number"),
    ("run-overrides-warm-spare-str", ["run", "--train-overrides", '{"warm_spare": "yes"}'],
     "setting warm_spare must be true or false"),
    ("train-warm-spare-value", ["train", "--run-dir", "r", "--warm-spare=yes"], "ignored explicit argument"),
    ("run-min-improvement-nan", ["run", "--min-improvement", "nan"], "--min-improvement must be a finite number"),
    ("run-min-improvement-inf", ["run", "--min-improvement=-inf"], "--min-improvement must be a finite number"),
    ("run-max-final-loss-nan", ["run", "--max-final-loss", "nan"], "--max-final-loss must be a finite number > 0"),
    ("run-max-final-loss-zero", ["run", "--max-final-loss", "0"], "--max-final-loss must be a finite number > 0"),
    ("run-promote-to-no-bucket", ["run", "--promote-to", "s3://"], "names no valid bucket"),
    ("run-promote-to-bad-bucket", ["run", "--promote-to", "s3://Bad_Bucket/x"], "names no valid bucket"),
    # stranger trial: the message quoted the URL with a sample run id in place of {run_id}
    ("run-promote-to-bad-bucket-run-id", ["run", "--promote-to", "s3://m/{run_id}"],
     "'s3://m/{run_id}' names no valid bucket"),
    ("run-export-unknown", ["run", "--export", "onnx"], "choose dcp, torch, safetensors, hf"),
    # stranger trial: int() reads digits of other scripts and underscores; --param and render-job refused them
    ("run-steps-arabic-indic-digits", ["run", "--steps", "٤٠"], "invalid int value: '٤٠'"),
    ("train-steps-underscore", ["train", "--run-dir", "r", "--steps", "1_0"], "invalid int value: '1_0'"),
    ("train-lr-fullwidth", ["train", "--run-dir", "r", "--lr", "０.１"], "invalid float value: '０.１'"),
    ("run-promote-to-dotdot", ["run", "--promote-to", "s3://models/a/../b"], "'..' part"),
    ("run-promote-to-ftp", ["run", "--promote-to", "ftp://host/x"], "only a directory or s3://"),
    ("run-promote-to-under-file", ["run", "--promote-to", "{file}/m"], "is a file, not a directory"),
    ("run-output-under-file", ["run", "--output-dir", "{file}/out"], "is a file, not a directory"),
    ("run-output-name-max", ["run", "--output-dir", LONG], "longer than the file system allows"),
    ("run-output-empty", ["run", "--output-dir", ""], "--output-dir is empty"),
    ("run-promote-to-s3-newline", ["run", "--promote-to", "s3://models/nightly\n"], "control character"),
    ("run-output-unwritable", ["run", "--output-dir", "{locked}/out"], "is not writable"),
    # found by a stranger trial: an empty --promote-to ran the whole pipeline into the default place
    ("run-promote-to-empty", ["run", "--promote-to", ""], "--promote-to is empty"),
    ("run-promote-to-blank", ["run", "--promote-to", " \n"], "--promote-to is empty"),
    # A fourth stranger trial: each trained the built-in task with no overrides, exit 0.
    ("run-task-empty", ["run", "--task", ""], "--task is empty: give a task MODULE:ATTR or path/to/file.py:ATTR"),
    ("run-train-overrides-blank", ["run", "--train-overrides", " "], "--train-overrides is empty: give a JSON object"),
    ("bench-task-empty", ["bench", "--task", ""], "--task is empty"),
    ("run-promote-to-newline", ["run", "--promote-to", "{work}/model\n"], "control character"),
    ("run-promote-to-misspelt-field", ["run", "--promote-to", "{work}/models/{runid}"], "not the field {run_id}"),
    # stranger trial: each trained the whole run, then failed at promotion with a traceback
    ("run-promote-to-inside-a-run", ["run", "--output-dir", "{work}/o", "--promote-to", "{work}/o/runs/{run_id}/m"],
     "is inside or around"),
    ("run-promote-to-output-dir", ["run", "--output-dir", "{work}/o", "--promote-to", "{work}/o"], "is inside or around"),
    # stranger trial: these passed the preflight, then promotion found them filled by the run
    ("run-promote-to-logs", ["run", "--output-dir", "{work}/o", "--promote-to", "{work}/o/logs"],
     "which the run fills itself"),
    ("run-promote-to-kfp-outputs", ["run", "--output-dir", "{work}/o", "--promote-to", "{work}/o/kfp/x"],
     "which the run fills itself"),
    ("run-local-dir-unusable", ["run", "--train-overrides",
                                '{"local_checkpoint_every": 5, "local_checkpoint_dir": "/proc/rt-no-such"}'],
     "cannot hold the node-local tier"),
    ("run-promote-to-uppercase-s3", ["run", "--promote-to", "S3://models/x"], "(lowercase s3://)"),
    # stranger trial: a 1-step run trained, then its gate could never pass (one step is both windows)
    ("run-one-step-cannot-converge", ["run", "--steps", "1", "--faults", ""], "min_improvement 0.1 can never pass"),
    # stranger trial: the default schedule's error read as if the user had given it
    ("run-steps-below-the-default-faults", ["run", "--steps", "6"], "the default --faults 'sigkill@12:1"),
    ("bench-steps-below-the-default-faults", ["bench", "--steps", "6"], "give --faults '' for none"),
    ("run-promote-to-space", ["run", "--promote-to", "{work}/model "], "leading or trailing whitespace"),
    ("run-task-arg-newline", ["run", "--task-arg", "lr=0.02\n"], "control character"),
    ("run-task-arg-repeated", ["run", "--task-arg", "lr=1", "--task-arg", "lr=2"], "task argument lr is given twice"),
    ("run-overrides-task-arg-repeated", ["run", "--train-overrides", '{"task_args": ["lr=1", "lr=2"]}'],
     "task argument lr is given twice"),
    ("bench-task-arg-repeated", ["bench", "--task-arg", "lr=1", "--task-arg", "lr=2"], "task argument lr is given twice"),
    ("bench-strategies-not-json", ["bench", "--strategies", "sync"], "--strategies is not valid JSON"),
    # stranger trial: json.loads kept the last, and the run trained at lr 2 without a word
    ("run-overrides-key-repeated", ["run", "--train-overrides", '{"lr": 1, "lr": 2}'],
     "--train-overrides: key 'lr' is given twice (JSON would keep only the last): give it once"),
    ("bench-strategies-key-repeated", ["bench", "--strategies", '[{"name": "a", "name": "b"}]'],
     "--strategies: key 'name' is given twice"),
    # stranger trial: nested past the parser's stack, a RecursionError traceback
    ("run-overrides-nested-too-deeply", ["run", "--train-overrides", "[" * 5000 + "]" * 5000],
     "--train-overrides is JSON nested too deeply"),
    ("run-overrides-huge-integer-float", ["run", "--train-overrides", '{"lr": 1' + "0" * 400 + "}"],
     "setting lr must be a finite number"),
    ("bench-strategies-list-of-int", ["bench", "--strategies", "[1]"], "must be a JSON list of objects"),
    ("bench-output-under-file", ["bench", "--output-dir", "{file}/out"], "is a file, not a directory"),
    ("bench-strategy-unknown-setting", ["bench", "--strategies", '[{"name": "a", "bogus": 1}]'],
     "strategy a: unknown trainer settings: bogus"),
    ("bench-strategy-bad-value", ["bench", "--strategies", '[{"name": "a", "checkpoint_every": 0}]'],
     "strategy a: checkpoint_every must be a positive"),
    ("bench-strategies-duplicate", ["bench", "--strategies", '[{"name": "a"}, {"name": "a"}]'], "unique names"),
    ("bench-strategies-empty", ["bench", "--strategies", "[]"], "at least one strategy"),
    # --- render-job
    ("render-o-empty", [*RENDER, "-o", ""], "-o is empty"),
    ("render-o-dir", [*RENDER, "-o", "{dir}"], "is a directory: name a file"),
    ("render-o-under-file", [*RENDER, "-o", "{file}/job.yaml"], "is a file, not a directory"),
    ("render-name-newline", ["render-job", "--name", "job\n", "--nodes", "1", "--gpus-per-node", "1",
                             "--pvc", "claim"], "not a DNS-1035 label"),
    ("render-namespace-newline", [*RENDER, "--namespace", "ns\n"], "not a DNS-1123 label"),
    # Trainer values the worker would fail on only once the job ran (stranger trial of render-job).
    ("render-seed-past-32-bits", [*RENDER, "--seed", str(2**64)], "seed must be between 0 and 4294967295"),
    ("render-seed-negative", [*RENDER, "--seed", "-1"], "seed must be between 0 and 4294967295"),
    ("render-step-seconds-huge", [*RENDER, "--step-seconds", "1e308"], "step_seconds must be between 0 and 3600"),
    ("render-pg-timeout-huge", [*RENDER, "--pg-timeout", "1e308"], "pg_timeout must be a positive number of seconds"),
    ("render-min-world-size-negative", [*RENDER, "--min-world-size", "-1"], "min_world_size must be >= 0"),
    ("render-min-world-size-past-the-world", [*RENDER, "--min-world-size", "2"],
     "min_world_size 2 exceeds the world size 1 (nodes 1 x 1 per node)"),
    ("render-gpu-reclaim-timeout-negative", [*RENDER, "--gpu-reclaim-timeout", "-1"], "gpu_reclaim_timeout must be"),
    ("render-gpu-reclaim-tolerance-negative", [*RENDER, "--gpu-reclaim-tolerance-mb", "-1"],
     "gpu_reclaim_tolerance_mb must be >= 0"),
    ("render-steps-past-64-bits", [*RENDER, "--steps", str(2**64)], "does not fit 64 bits"),
    ("render-nvrx-version-word", [*RENDER, "--nvrx-version", "banana"], "nvrx_version must be an NVRx release"),
    ("render-nvrx-version-too-old", [*RENDER, "--nvrx-version", "0.3.9"], "at least 0.4.0"),
    ("render-nvrx-version-newline", [*RENDER, "--nvrx-version", "0.7.0\n"], "nvrx_version must be an NVRx release"),
    ("render-image-uppercase", [*RENDER, "--image", "ghcr.io/Org/trainer:1"], "is not an image reference"),
    ("render-image-empty-tag", [*RENDER, "--image", "trainer:"], "is not an image reference"),
    ("render-image-bad-digest", [*RENDER, "--image", "trainer@sha256:xyz"], "is not an image reference"),
    ("render-claim-newline", [*RENDER[:-1], "claim\n"], "claim name"),
    ("render-service-account-newline", [*RENDER, "--service-account", "sa\n"], "service account"),
    ("render-priority-class-newline", [*RENDER, "--priority-class", "high\n"], "priority class"),
    ("render-env-name-newline", [*RENDER, "--env", "FOO\n=1"], "environment variable name"),
    ("render-memory-newline", [*RENDER, "--memory", "1Gi\n"], "not a Kubernetes quantity"),
    ("render-shm-newline", [*RENDER, "--shm-size", "64Gi\n"], "not a Kubernetes quantity"),
    ("render-cpu-negative", [*RENDER, "--cpu", "-1"], "not a Kubernetes quantity"),
    ("render-node-selector-newline", [*RENDER, "--node-selector", "zone=a\n"], "not a valid label value"),
    ("render-toleration-newline", [*RENDER, "--toleration", "gpu\n:NoSchedule"], "toleration key"),
    ("render-run-dir-escapes", [*RENDER, "--run-dir", "/mnt/run/../../etc/x"], "without '.', '..'"),
    ("render-run-dir-outside", [*RENDER, "--run-dir", "/mnt/other/x"], "must lie under the storage mount"),
    ("render-run-id-escapes", [*RENDER, "--run-id", "../../etc"], "without '.', '..'"),
    ("render-mount-dev-shm", [*RENDER, "--mount-path", "/dev/shm"], "collides with /dev/shm"),
    ("render-mount-inside-dev-shm", [*RENDER, "--mount-path", "/dev/shm/run"], "collides with /dev/shm"),
    ("render-mount-dev", [*RENDER, "--mount-path", "/dev"], "collides with /dev/shm"),
    ("render-mount-dotdot", [*RENDER, "--mount-path", "/mnt/../dev/shm"], "without '.', '..'"),
    ("render-missing-required", ["render-job", "--nodes", "1"], "the following arguments are required"),
    # stranger trial: a relative fault file was written into the job, to be read from the pod's directory
    ("render-faults-relative-file", [*RENDER, "--faults", "faults.yml", "-o", "{work}/job.yaml"],
     "faults: 'faults.yml' is a fault file read inside the pods: give its absolute path there"),
    # found by a stranger trial: accepted (a sizeLimit the CRDs reject; tolerate every taint; past int32) or a traceback
    ("render-shm-empty", [*RENDER, "--shm-size", ""], "not a Kubernetes quantity"),
    ("render-toleration-empty", [*RENDER, "--toleration", ""], "names no KEY"),
    ("render-toleration-no-key", [*RENDER, "--toleration", ":NoSchedule"], "names no KEY"),
    ("render-backoff-past-int32", [*RENDER, "--backoff-limit", "2147483648"], "between 0 and 2147483647"),
    ("render-ttl-past-int32", [*RENDER, "--ttl", "99999999999"], "between 0 and 2147483647"),
    ("render-max-restarts-past-int32", [*RENDER, "--max-restarts", "99999999999"], "at most 2147483647"),
    ("render-o-proc", [*RENDER, "-o", "/proc/rt-bad-input/job.yaml"], "cannot write -o"),
    # --- compile and the KFP server commands
    ("compile-o-under-file", ["compile", "--registry", REGISTRY, "-o", "{file}/out"], "is a file, not a directory"),
    ("compile-o-yaml-is-dir", ["compile", "--registry", REGISTRY, "--pipeline", "tiny-train", "-o", "{dir}.yaml"],
     "is a directory: name a file"),
    ("compile-unknown-pipeline", ["compile", "--registry", REGISTRY, "--pipeline", "nope"], "nope"),
    ("compile-registry-not-pipelines", ["compile", "--registry", "os:environ"], "not a @dsl.pipeline"),
    ("compile-registry-empty", ["compile", "--registry", ""], "names no module"),
    ("compile-registry-colon", ["compile", "--registry", ":"], "names no module"),
    ("compile-o-empty", ["compile", "--registry", REGISTRY, "-o", ""], "-o is empty"),
    ("compile-argo-o-blank", ["compile", "--format", "argo", "-o", " "], "-o is empty"),
    ("compile-argo-o-newline", ["compile", "--format", "argo", "-o", "d\n"], "control character"),
    ("compile-argo-o-file", ["compile", "--format", "argo", "-o", "{file}"], "exists and is not a directory"),
    ("compile-argo-o-proc", ["compile", "--format", "argo", "-o", "/proc/rt-bad-input"], "cannot write"),
    # found by a stranger trial: the file system's refusal read "pipeline ... does not compile"
    ("compile-o-file-in-proc", ["compile", "--pipeline", "resilient-training", "-o", "/proc/rt-bad-input.yaml"],
     "-o /proc/rt-bad-input.yaml: cannot write /proc/rt-bad-input.yaml"),
    ("compile-argo-deadline-past-int64", ["compile", "--format", "argo", "--starting-deadline", "9" * 20], "int64"),
    ("runs-token-space", ["runs", *HOST, "--token", "s3cret value"], "contains a space, control or non-ASCII"),
    ("runs-token-blank", ["runs", *HOST, "--token", " \n"], "is empty"),
    ("runs-host-newline", ["runs", "--host", "http://127.0.0.1:9\n"], "control character"),
    ("runs-limit-0", ["runs", *HOST, "--limit", "0"], "--limit must be at least 1"),
    ("runs-timeout-nan", ["runs", *HOST, "--timeout", "nan"], "--timeout must be a positive number"),
    ("runs-namespace-newline", ["runs", *HOST, "--namespace", "team-a\n"], "not a DNS-1123 label"),
    ("schedule-cron-5-fields", ["schedule", *HOST, "--registry", REGISTRY, "--cron", "0 2 * * *"], "has 5 fields"),
    ("schedule-concurrency-0", ["schedule", *HOST, "--registry", REGISTRY, "--cron", "0 0 2 * * *",
                                "--max-concurrency", "0"], "--max-concurrency must be 1-10"),
    ("submit-unknown-param", ["submit", *HOST, "--registry", REGISTRY, "--package", "--param", "bogus=1"], "bogus"),
    # --- gates
    ("validate-missing", ["validate-checkpoint", "{work}/nothing"], "does not exist"),
    ("validate-file", ["validate-checkpoint", "{file}"], "is not a directory"),
    ("validate-threads-0", ["validate-checkpoint", "--threads", "0", "{run}"], "--threads must be at least 1"),
    # found by a stranger trial: a path with a newline split the error over two lines
    ("validate-path-newline", ["validate-checkpoint", "{run}\n"], "control character"),
    ("convergence-min-improvement-nan", ["check-convergence", "--min-improvement", "nan", "{run}"],
     "min_improvement must be a finite number"),
    ("convergence-rtol-nan", ["check-convergence", "--continuity-rtol", "nan", "{run}"], "continuity_rtol"),
    ("convergence-window-0", ["check-convergence", "--window", "0", "{run}"], "window must be at least 1"),
    ("convergence-not-a-run", ["check-convergence", "{dir}"], "no events/"),
    ("convergence-reference-missing", ["check-convergence", "{run}", "--reference", "{work}/nothing"],
     "does not exist"),
    ("convergence-max-final-loss-inf", ["check-convergence", "{run}", "--max-final-loss", "inf"],
     "max_final_loss must be finite"),
    ("export-no-format", ["export", "{run}", "-o", "{work}/m.safetensors"], "give --format"),
    ("export-bad-format", ["export", "{run}", "--format", "onnx", "-o", "{work}/m"], "choose one of dcp"),
    ("export-no-such-step", ["export", "{run}", "--format", "torch", "--step", "999", "-o", "{work}/m.pt"],
     "no committed checkpoint at step 999"),
    ("export-negative-step", ["export", "{run}", "--format", "torch", "--step", "-1", "-o", "{work}/m.pt"],
     "--step must be >= 0"),
    ("export-out-newline", ["export", "{run}", "--format", "torch", "-o", "{work}/m.pt\n"], "control character"),
    ("export-out-under-file", ["export", "{run}", "--format", "safetensors", "-o", "{file}/m.safetensors"],
     "is a file, not a directory"),
    ("export-out-in-checkpoints", ["export", "{run}", "--format", "torch", "-o", "{run}/checkpoints/m.pt"],
     "lies inside the run's checkpoints/"),
    ("export-missing-run", ["export", "{work}/nothing", "--format", "torch", "-o", "{work}/m.pt"], "does not exist"),
    ("export-run-newline", ["export", "{run}\n", "--format", "torch", "-o", "{work}/m.pt"], "control character"),
    # found by a stranger trial: a missing directory was "not a directory", and gates/ and events/ took exports
    ("export-out-dir-missing", ["export", "{run}", "--format", "safetensors", "-o", "exp/m.safetensors"],
     "exp does not exist"),
    ("export-out-in-gates", ["export", "{run}", "--format", "torch", "-o", "{run}/gates/m.pt"],
     "lies inside the run's gates/"),
    ("export-out-in-events", ["export", "{run}", "--format", "torch", "-o", "{run}/events/m.pt"],
     "lies inside the run's events/"),
    # found by a stranger trial: with a checkpoint not yet validated, this was "refused" (exit 1)
    ("export-out-in-proc", ["export", "{run}", "--format", "torch", "-o", "/proc/rt-m.pt"],
     "cannot create a file in /proc"),
    ("export-dcp-out-in-proc", ["export", "{run}", "--format", "dcp", "-o", "/proc/rt-m"],
     "cannot create a file in /proc"),
    ("promote-s3-dotdot", ["promote", "{run}", "s3://models/x/../y"], "'..' part"),
    ("promote-dest-in-run", ["promote", "{run}/checkpoints/step_4", "{run}/checkpoints/step_4/model"],
     "lies inside the source run"),
    ("promote-dest-is-run-parent", ["promote", "{run}", "{run}/.."], "contains the source run"),
    ("promote-dest-empty", ["promote", "{run}", ""], "DEST is empty"),
    ("promote-dest-newline", ["promote", "{run}", "{work}/model\n"], "trailing whitespace"),
    ("promote-dest-s3-no-bucket", ["promote", "{run}", "s3:///x"], "names no valid bucket"),
    ("promote-missing-checkpoint", ["promote", "{work}/nothing", "{work}/model"], "does not exist"),
    ("promote-dest-name-max", ["promote", "{run}", f"{{work}}/{LONG[:250]}"], "longer than the file system allows"),
    ("report-o-empty", ["report", "{run}", "-o", ""], "-o is empty"),
    ("promote-dest-s3-newline", ["promote", "{run}", "s3://models/m\n"], "trailing whitespace"),
    ("promote-dest-inner-newline", ["promote", "{run}", "{work}/mo\ndel"], "control character"),
    ("promote-checkpoint-newline", ["promote", "{run}\n", "{work}/model"], "control character"),
    ("report-run-newline", ["report", "{run}\n", "-o", "{work}/r.html"], "control character"),
    # found by a stranger trial: access() says yes to root on /proc, and the write ended in a traceback
    ("report-o-in-proc", ["report", "{run}", "-o", "/proc/rt-report.html"], "cannot create a file in /proc"),
    ("report-json-in-proc", ["report", "{run}", "--json", "/proc/rt-no-such/m.json"], "cannot create a file in /proc"),
    ("report-o-dir", ["report", "{run}", "-o", "{dir}"], "is a directory: name a file"),
    ("report-o-root", ["report", "{run}", "-o", "/"], "is a directory: name a file"),
    ("report-o-under-file", ["report", "{run}", "-o", "{file}/r.html"], "is a file, not a directory"),
    ("report-json-dir", ["report", "{run}", "--json", "{dir}"], "is a directory: name a file"),
    ("report-o-name-max", ["report", "{run}", "-o", LONG], "longer than the file system allows"),
    ("report-same-file", ["report", "{run}", "-o", "r.json", "--json", "r.json"], "both name"),
    # a stranger trial's `report -o /dev/stdout` (root) replaced /dev/stdout with a file: a file is
    # replaced through a temporary one beside it, which replaces a link, not what it leads to
    ("report-o-link", ["report", "{run}", "-o", "{work}/a-link"], "is a symbolic link (to "),
    ("report-json-link", ["report", "{run}", "--json", "{work}/a-link"], "is a symbolic link (to "),
    ("report-o-device", ["report", "{run}", "-o", "/dev/null"], "is not a regular file"),
    ("report-both-stdout", ["report", "{run}", "-o", "-", "--json", "-"], "both name -"),
    ("export-o-link", ["export", "{run}", "--format", "torch", "-o", "{work}/a-link"], "is a symbolic link (to "),
    ("render-job-o-link", [*RENDER, "-o", "{work}/a-link"], "is a symbolic link (to "),
    ("report-nothing-asked", ["report", "{run}"], "give -o report.html and/or --json"),
    ("report-over-event-log", ["report", "{run}", "--json", "{run}/events/rank0.jsonl"], "the run's own records"),
    ("report-over-config", ["report", "{run}", "-o", "{run}/config.json"], "the run's own records"),
    ("report-into-gates", ["report", "{run}", "-o", "{run}/gates/report.html"], "the run's own records"),
    ("report-not-a-run", ["report", "{dir}", "-o", "r.html"], "no events/"),
    ("unknown-command", ["bogus"], "invalid choice"),
    # found by a stranger trial: an input name past NAME_MAX, or a loop of links, was a traceback
    ("validate-name-max", ["validate-checkpoint", f"{{work}}/{LONG}"], "longer than the file system allows"),
    ("convergence-name-max", ["check-convergence", f"{{work}}/{LONG}"], "longer than the file system allows"),
    ("convergence-reference-name-max", ["check-convergence", "{run}", "--no-record", "--reference",
                                        f"{{work}}/{LONG}"], "longer than the file system allows"),
    ("promote-checkpoint-name-max", ["promote", f"{{work}}/{LONG}", "{work}/m"], "longer than the file system allows"),
    ("promote-dest-name-max-300", ["promote", "{run}", f"{{work}}/{LONG}"], "longer than the file system allows"),
    ("export-run-name-max", ["export", f"{{work}}/{LONG}", "--format", "torch", "-o", "m.pt"],
     "longer than the file system allows"),
    ("report-run-name-max", ["report", f"{{work}}/{LONG}", "-o", "r.html"], "longer than the file system allows"),
    ("report-link-loop", ["report", "{work}/loop-a", "-o", "r.html"], "too many levels of symbolic links"),
    # stranger trial: "cannot write ...: File exists" for an output through a dangling link
    ("compile-argo-out-dangling-link", ["compile", "--format", "argo", "-o", "{work}/loop-a/"],
     "loop-a is a symbolic link to"),
    ("render-job-out-dangling-link", [*RENDER, "-o", "{work}/loop-a/x.yaml"],
     "which leads nowhere (a dangling link or a loop)"),
    # stranger trial: `compile -o LINK` to a missing directory created the link's target with the YAML in it
    ("compile-out-dangling-link", ["compile", "-o", "{work}/dangling"], "which leads nowhere"),
    ("validate-link-loop", ["validate-checkpoint", "{work}/loop-a"], "too many levels of symbolic links"),
    # stranger trial: malformed s3: targets became local directories ./s3:/bucket/x, exit 0
    ("promote-s3-one-slash", ["promote", "{run}", "s3:/bucket/x"], "s3:/bucket/x is not an s3://bucket/prefix URL"),
    ("promote-s3-no-slash", ["promote", "{run}", "s3:bucket"], "s3:bucket is not an s3://bucket/prefix URL"),
    # stranger trial: outputs that take only local paths wrote local files named s3:...
    ("export-o-s3", ["export", "{run}", "--format", "torch", "-o", "s3://bucket/y.pt"],
     "-o takes a local path, not an s3:// URL"),
    ("report-o-s3", ["report", "{run}", "-o", "s3://bucket/r.html"], "-o takes a local path, not an s3:// URL"),
    ("report-json-s3", ["report", "{run}", "--json", "s3:bucket/m.json"], "--json takes a local path, not an s3://"),
    ("render-job-o-s3", [*RENDER, "-o", "s3://bucket/job.yaml"], "-o takes a local path, not an s3:// URL"),
    # A stranger trial: taken, and every worker of the built-in task then exited 93 (compile refuses it).
    ("render-job-hf-of-the-gpt-task", [*RENDER, "--export-format", "hf"],
     "export_format hf writes a transformers model, and the built-in GPT task's is not one"),
    ("compile-o-s3", ["compile", "-o", "s3://bucket/compiled"], "-o takes a local path, not an s3:// URL"),
    ("compile-argo-o-s3", ["compile", "--format", "argo", "-o", "s3://bucket/argo"],
     "-o takes a local path, not an s3:// URL"),
    # stranger trial: S3 destinations S3 itself would refuse, or that lose a part, were accepted
    ("promote-s3-double-slash", ["promote", "{run}", "s3://models//x"], "the prefix has an empty, '.' or '..' part"),
    ("promote-s3-ip-bucket", ["promote", "{run}", "s3://192.168.1.1/x"], "an IP address"),
    ("promote-s3-dotdot-bucket", ["promote", "{run}", "s3://bu..cket/x"], "two adjacent periods"),
    ("promote-s3-xn-bucket", ["promote", "{run}", "s3://xn--bucket/x"], "begins with 'xn--'"),
    ("promote-s3-long-prefix", ["promote", "{run}", "s3://models/" + "p/" * 460 + "x"],
     "S3 keys are at most 1024 bytes"),
    ("validate-empty", ["validate-checkpoint", ""], "RUN_OR_CHECKPOINT is empty"),
    ("convergence-reference-empty", ["check-convergence", "{run}", "--no-record", "--reference", ""],
     "--reference is empty"),
]


def _build_run(path: Path) -> None:
    write_checkpoint(path, step=4)
    log = ScriptedLog(path)
    log.steps(1, 8, checkpoint_every=4)
    log.end()
    log.close()


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small run (checkpoint at step 4, event log) that bad input must leave untouched; read-only."""
    return build_once(tmp_path_factory.getbasetemp(), "bad-input-run", _build_run)


@pytest.fixture
def locked(tmp_path: Path) -> Path:
    """A directory nobody can write into (root included: the immutable attribute)."""
    path = tmp_path / "locked"
    path.mkdir()
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        if os.geteuid() == 0:
            pytest.skip("chattr +i unsupported here and root ignores mode bits")
        path.chmod(0o555)
    yield path
    subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    path.chmod(0o755)


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for root in roots for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize(("argv", "reason"), [pytest.param(a, r, id=i) for i, a, r in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
        argv: list[str], reason: str, tmp_path: Path, shared_run: Path, locked: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("KF_PIPELINES_ENDPOINT", "KF_PIPELINES_TOKEN", "KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "no-such-token"))
    work = tmp_path / "work"
    (work / "dir").mkdir(parents=True)
    (work / "dir.yaml").mkdir()
    (work / "a-file").write_text("keep me")
    (work / "a-link").symlink_to(work / "a-file")
    (work / "loop-a").symlink_to(work / "loop-b")
    (work / "loop-b").symlink_to(work / "loop-a")
    (work / "dangling").symlink_to(tmp_path / "nowhere" / "deeper")
    places = {"work": str(work), "dir": str(work / "dir"), "file": str(work / "a-file"), "run": str(shared_run),
              "locked": str(locked)}
    args = []
    for arg in argv:
        if arg.startswith("yaml:"):
            schedule = tmp_path / "schedule.yaml"
            schedule.write_text(arg.removeprefix("yaml:"))
            arg = str(schedule)
        for key, value in places.items():
            arg = arg.replace("{" + key + "}", value)
        args.append(arg)
    monkeypatch.chdir(work)
    before = snapshot(tmp_path, shared_run)
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line
    assert "Traceback" not in err and reason in err, err
    assert snapshot(tmp_path, shared_run) == before  # nothing created, nothing changed


@pytest.mark.parametrize(("fmt", "inside"), [("safetensors", "events/zz.jsonl"), ("dcp", "checkpoints/step_25"),
                                           ("torch", "gates/m.pt"), ("torch", "config.json")])
def test_an_export_into_another_runs_records_is_refused(fmt: str, inside: str, tmp_path: Path, shared_run: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a third stranger trial: `export` refused only its own run's records; one into another
    run's events/ made that run's convergence gate fail (and delete its record), one into its
    checkpoints/ a committed-looking step_25 holding the first run's manifest."""
    from tests.support.gates import copy_run

    other = copy_run(shared_run, tmp_path / "other")
    (other / "config.json").unlink(missing_ok=True)  # a run is its events/ and checkpoints/ too
    before = snapshot(other)
    code = main(["export", str(shared_run), "--format", fmt, "-o", str(other / inside)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"lies inside the run {other}'s {inside.split('/')[0]}" in err, err
    assert snapshot(other) == before


@pytest.mark.parametrize("command", ["report", "export"])
def test_the_runs_evidence_behind_a_symlink_takes_no_output(command: str, tmp_path: Path, shared_run: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose events/ is a symlink keeps its evidence at the link's target: no output lands there."""
    from tests.support.gates import copy_run

    run = copy_run(shared_run, tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    (run / "events").rename(elsewhere)
    (run / "events").symlink_to(elsewhere)
    out = elsewhere / "out.html"
    argv = ["report", str(run), "-o", str(out)] if command == "report" else \
        ["export", str(run), "--format", "torch", "-o", str(out)]
    before = snapshot(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "events/" in err, err
    assert snapshot(tmp_path) == before


def test_the_corpus_covers_every_command() -> None:
    from resilient_training.cli.main import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001
    covered = {argv[0] for _, argv, _ in CASES}
    assert len(CASES) >= 40
    assert commands - covered <= {"upload", "schedules"}  # server listings: one shared check path with runs
    assert "bogus" in covered


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("how", ["--token", "env", "in-cluster-file"])
def test_a_token_with_a_trailing_newline_is_stripped_and_sent(how: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """What a Secret-mounted value carries (a trailing newline) is not part of the token."""
    for name in ("KF_PIPELINES_ENDPOINT", "KF_PIPELINES_TOKEN", "KUBECONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "no-such-token"))
    args = []
    if how == "--token":
        args = ["--token", "s3cret\n"]
    elif how == "env":
        monkeypatch.setenv("KF_PIPELINES_TOKEN", "s3cret\r\n")
    else:
        (tmp_path / "token").write_text("s3cret\n")
        monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "token"))
    with FakeKfpServer(token="s3cret") as server:
        code = main(["runs", "--host", server.url, *args])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert {r.headers.get("authorization") for r in server.requests} == {"Bearer s3cret"}
    assert "s3cret" not in out + err


def test_a_bad_token_is_never_printed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "no-such-token"))
    monkeypatch.setenv("KF_PIPELINES_TOKEN", "top\nsecret-value")
    code = main(["runs", *HOST])
    out, err = capsys.readouterr()
    assert code == 2 and "KF_PIPELINES_TOKEN" in err
    assert "secret-value" not in out + err and "top" not in out + err
    from resilient_training.kfp.client import Auth

    assert "secret-value" not in repr(Auth("secret-value", "--token"))


@pytest.mark.parametrize("when", ["importing-a-command", "in-the-command"])
def test_ctrl_c_before_a_command_starts_anything_is_one_line_and_130(when: str) -> None:
    """A stranger trial pressed Ctrl-C in the CLI's first second (its modules importing): a traceback.
    A real SIGINT, sent by the process to itself while the parser imports a command's module, or
    while a command runs that has no Ctrl-C handling of its own.
    """
    import signal
    import sys

    script = f"""
import importlib, os, signal, sys
import resilient_training.cli.main as cli
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's shell leaves it
real = importlib.import_module
def import_module(name, *args):
    if {when!r} == "importing-a-command" and name.endswith(".gates"):
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *args)
cli.importlib.import_module = import_module
import resilient_training.cli.render as render
def render_job(args):
    os.kill(os.getpid(), signal.SIGINT)
    return 0
real_register = render.register
def register(subparsers):
    real_register(subparsers)
    subparsers.choices["render-job"].set_defaults(func=render_job)
render.register = register
sys.exit(cli.main(["render-job", "--name", "j", "--nodes", "1", "--gpus-per-node", "8", "--pvc", "c"]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stderr.splitlines()[-1:] == ["interrupted (Ctrl-C)"] and "Traceback" not in done.stderr, done.stderr


def test_run_refuses_an_output_dir_inside_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Stranger trial: `run --output-dir <a run>` nested runs/, kfp/ and logs/ in that run's evidence."""
    from resilient_training.cli.main import main

    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for output in (run, run / "out"):
        assert main(["run", "--output-dir", str(output), "--faults", ""]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is inside the run directory {run}" in err, err
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "events"]
