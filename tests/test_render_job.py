"""`resilient-training render-job`: writes a valid PyTorchJob, refuses bad input with the reason."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from fractions import Fraction

import pytest
import yaml

from resilient_training.cli import main as cli
from tests.support import crd_schema


def test_render_job_writes_a_valid_job(tmp_path, shared_schemas):
    out = tmp_path / "job.yaml"
    code = cli.main(["render-job", "--name", "llama-ft", "--nodes", "64", "--gpus-per-node", "8", "--image",
                     "registry.example.com/rt/trainer:0.1.0", "--pvc", "fsx-claim", "--namespace", "team-a",
                     "--efa", "32", "--node-selector", "node.kubernetes.io/instance-type=p5.48xlarge",
                     "--toleration", "nvidia.com/gpu:NoSchedule", "--steps", "2000", "--faults", "sigkill@500:17",
                     "--heartbeat-timeout", "300", "--model-d-model", "2048", "--model-n-heads", "16",
                     "--task", "team_a.train:task", "--task-arg", "data=/mnt/run/text/*.txt", "-o", str(out)])
    assert code == 0
    job = yaml.safe_load(out.read_text())
    schema = crd_schema.load_crd_schema(shared_schemas / "kubeflow.org_pytorchjobs.yaml")
    assert crd_schema.schema_errors(job, schema) == [] and crd_schema.webhook_errors(job) == []
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--run-dir") + 1] == "/mnt/run/runs/llama-ft"
    assert args[args.index("--faults") + 1] == "sigkill@500:17"
    assert "--ft-rank-heartbeat-timeout=300.0" in args
    assert args[args.index("--task") + 1] == "team_a.train:task"  # imported in the trainer image, not here
    assert args[args.index("--task-arg") + 1] == "data=/mnt/run/text/*.txt"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 64


@pytest.mark.parametrize(("argv", "reason"), [
    (["--name", "Llama_FT"], "is not a DNS-1035 label"),
    (["--nodes", "0"], "nodes must be an integer from 1"),
    (["--gpus-per-node", "-2"], "gpus_per_node must be between 0 and 64"),
    (["--pvc", "Bad_Claim"], "is not a DNS-1123 subdomain"),
    (["--mount-path", "data"], "mount path 'data' must be an absolute directory"),
    (["--node-selector", "no-equals-sign"], "must be KEY=VALUE"),
    (["--steps", "0"], "steps must be positive"),
    # Accepted without a word before (stranger trial): sizeLimit '0' is an unbounded tmpfs.
    (["--shm-size", "0"], "shm_size '0' is zero"),
    (["--cpu", "0"], "cpu '0' is zero"),
    (["--memory", "0Gi"], "memory '0Gi' is zero"),
    (["--shm-size", "99999999999Ei"], "shm_size '99999999999Ei' is past the largest byte count"),
    (["--memory", "32Gi", "--shm-size", "64Gi"], "shm_size '64Gi' exceeds memory '32Gi': /dev/shm is memory-backed"),
    (["--env", "K=v\n"], "--env 'K=v\\n': the value contains a control character"),
    (["--service-account", "Bad_SA"], "service account 'Bad_SA' is not a DNS-1123 subdomain"),
    # Stranger trial 6: int() read Unicode digits; the last of a repeated key won; 'a:' tolerated every effect.
    (["--nodes", "\u0662"], "argument --nodes: invalid int value: '\u0662'"),  # argparse's own: SystemExit(2)
    (["--efa", "\u0663"], "argument --efa: invalid int value: '\u0663'"),
    (["--steps", "\u0664\u0660"], "argument --steps: invalid int value"),
    (["--efa", "1_0"], "argument --efa: invalid int value: '1_0'"),
    (["--node-selector", "a=b", "--node-selector", "a=c"], "--node-selector 'a' is given twice (a=b, a=c)"),
    (["--env", "K=1", "--env", "K=2"], "--env 'K' is given twice"),
    (["--toleration", "a:"], "toleration 'a:' has no EFFECT after ':'"),
    (["--memory", "1", "--shm-size", "1"], "memory '1' is below 1Gi"),
    (["--memory", "1023Mi", "--shm-size", "1Mi"], "memory '1023Mi' is below 1Gi"),
    (["--shm-size", "255Mi"], "shm_size '255Mi' is below 256Mi"),
    (["--toleration", "a=b:"], "toleration 'a=b:' has no EFFECT after ':'"),
    # A stranger trial: a run id became a 300-byte directory name, a nested directory ('run/x'), or a
    # directory ('run id') whose label and rdzvId ('run-id') another run id shares.
    (["--run-id", "a" * 300], "--run-id 'aaaa"),
    (["--run-id", "a" * 64], "must be at most 63 letters, digits, '.', '_' or '-'"),
    (["--run-id", "run/x"], "--run-id 'run/x' must be at most 63 letters"),
    (["--run-id", "run id"], "--run-id 'run id' must be at most 63 letters"),
    (["--run-id", "run id", "--run-dir", "/mnt/run/x"], "--run-id 'run id' must be"),
    (["--run-id", "run-"], "--run-id 'run-' must be"),
    (["--run-id", "r\u00e9sum\u00e9"], "must be at most 63 letters"),
    (["--run-dir", "/mnt/run/" + "a" * 300], "run_dir: the name aaaaaaaaaaaaaaaaaaaaaaaa... is 300 bytes, longer than"),
    (["--run-dir", "/mnt/run/" + "/".join(["a" * 250] * 17)], "run_dir is 4275 bytes long, past Linux's limit"),
    (["--local-checkpoint-dir", "relative", "--local-checkpoint-every", "5"],
     "local_checkpoint_dir 'relative' must be an absolute directory"),
    (["--local-checkpoint-dir", "/dev/shm/" + "b" * 256], "local_checkpoint_dir: the name bbbb"),
    # A leading '//' passed the check whose message refuses it; a trailing space made a directory ending in one.
    (["--mount-path", "//mnt/run"], "mount path '//mnt/run' must be an absolute directory"),
    (["--run-dir", "//mnt/run/x"], "run_dir '//mnt/run/x' must be an absolute directory"),
    (["--local-checkpoint-dir", "/scratch/x ", "--local-checkpoint-every", "5"],
     "local_checkpoint_dir '/scratch/x ' must be an absolute directory"),
    # Kubernetes quantities the old pattern refused (stranger trial); negative, too small or past int64 still are.
    (["--memory=-2Gi", "--shm-size=1Gi"], "memory '-2Gi' is negative"),
    (["--cpu", "-.5"], "cpu '-.5' is negative"),
    (["--memory", "129e6"], "memory '129e6' is below 1Gi"),
    (["--shm-size", "1e3"], "shm_size '1e3' is below 256Mi"),
    (["--memory", "1e19"], "memory '1e19' is past the largest byte count"),
    (["--memory", "1e2147483647"], "memory '1e2147483647' is past the largest byte count"),
    (["--cpu", "1e"], "cpu '1e' is not a Kubernetes quantity"),
    (["--cpu", "1e1.5"], "cpu '1e1.5' is not a Kubernetes quantity"),
    (["--cpu", "."], "cpu '.' is not a Kubernetes quantity"),
    (["--cpu", "1ki"], "cpu '1ki' is not a Kubernetes quantity"),
    (["--cpu", "1e2147483648"], "cpu '1e2147483648' is not a Kubernetes quantity"),  # Go reads its int32 wrapped
    (["--cpu", "1e" + "9" * 5000], "is not a Kubernetes quantity"),
])
def test_render_job_refuses_bad_input_with_the_reason(argv, reason, tmp_path, capsys):
    base = {"--name": "ok-job", "--nodes": "2", "--gpus-per-node": "8", "--pvc": "claim"}
    flags = dict(base)
    extra = []
    for i in range(0, len(argv), 2):
        if argv[i] in flags:
            flags[argv[i]] = argv[i + 1]
        else:
            extra += argv[i:i + 2]
    out = tmp_path / "job.yaml"
    try:
        code = cli.main(["render-job", *[x for kv in flags.items() for x in kv], *extra, "-o", str(out)])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert reason in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_worker_pods_run_as_the_trainer_service_account_by_default(kind, shared_schemas, capsys):
    # Without --service-account the pods ran as the namespace's default, its token mounted (stranger trial).
    code = cli.main(["render-job", "--kind", kind, "--name", "j", "--nodes", "1", "--gpus-per-node", "8", "--pvc", "c",
                     "-o", "-"])
    assert code == 0
    job = yaml.safe_load(capsys.readouterr().out)
    if kind == "pytorchjob":
        pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        schema = crd_schema.load_crd_schema(shared_schemas / "kubeflow.org_pytorchjobs.yaml")
        assert crd_schema.schema_errors(job, schema) == [] and crd_schema.webhook_errors(job) == []
        assert pod["serviceAccountName"] == "resilient-training-trainer"
    else:
        assert "resilient-training-trainer" in yaml.safe_dump(job)
    code = cli.main(["render-job", "--kind", kind, "--name", "j", "--nodes", "1", "--gpus-per-node", "8", "--pvc", "c",
                     "--service-account", "", "-o", "-"])
    assert code == 0 and "serviceAccountName" not in capsys.readouterr().out


def test_help_gives_each_default_once_and_no_empty_one(capsys):
    with pytest.raises(SystemExit):
        cli.main(["render-job", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 1234) (default: 1234)" not in text and "(default: 1234)" in text
    assert "(default: )" not in text
    assert "(default: resilient-training-trainer)" in text


def test_console_script_runs_render_job():
    proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", "render-job", "--name", "rt-x", "--nodes",
                           "2", "--gpus-per-node", "8", "--pvc", "claim"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["kind"] == "PyTorchJob"


@pytest.mark.parametrize(("tol", "ok"), [
    ({"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}, False),
    ({"key": "a", "operator": "Exists", "tolerationSeconds": 5}, False),  # no effect
    ({"key": "a", "effect": "NoExecute", "tolerationSeconds": 2**63}, False),
    ({"key": "a", "effect": "NoExecute", "tolerationSeconds": 300}, True),
    ({"key": "a", "effect": "NoExecute", "tolerationSeconds": -1}, True),  # Kubernetes: evict at once
    ({"key": "a", "effect": "NoExecute", "tolerationSeconds": 0}, True),
])
def test_toleration_seconds_only_with_no_execute(tol, ok):
    from resilient_training.launch import jobshape

    if ok:
        jobshape._check_toleration(tol)
    else:
        with pytest.raises(ValueError, match="tolerationSeconds"):
            jobshape._check_toleration(tol)


@pytest.mark.parametrize("tol", [{"operator": "Exists"}, {"key": "", "operator": "Exists"},
                                 {"operator": "Exists", "effect": "NoExecute"}])
def test_a_toleration_of_every_taint_is_refused_from_a_pipeline_parameter_too(tol):
    """A stranger trial: tolerations=[{"operator": "Exists"}] compiled (every taint tolerated, NoExecute
    too), which render-job's --toleration ':NoSchedule' refuses."""
    from resilient_training.launch import jobshape

    with pytest.raises(ValueError, match="Exists without a key tolerates every taint"):
        jobshape._check_toleration(tol)


def test_ascii_counts_and_a_toleration_without_colon_still_render(capsys):
    code = cli.main(["render-job", "--name", "j", "--nodes", "2", "--gpus-per-node", "8", "--pvc", "c", "--efa", "3",
                     "--toleration", "a", "--toleration", "b=c:NoExecute", "-o", "-"])
    assert code == 0
    job = yaml.safe_load(capsys.readouterr().out)
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "a", "operator": "Exists"},
                                  {"key": "b", "operator": "Equal", "value": "c", "effect": "NoExecute"}]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2


class _KubectlLoader(yaml.SafeLoader):
    """Reads plain scalars as kubectl does (go-yaml v2): ``1e3`` and ``2e-3`` are numbers, which PyYAML keeps as text."""


_KubectlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$"), list("-+.0123456789"))


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize(("cpu", "memory", "shm"), [
    ("2e-3", "129e9", "1e9"), (".5", "+2Gi", "5.e8"), ("5.", "2E9", "1e+9"), ("1n", "1.5Gi", "0.5Gi"),
    ("1u", "1E", "1E9"), ("250m", "64e9", "256Mi"), ("+1", "2000000000", "2.7e8"),
])
def test_render_job_takes_every_kubernetes_quantity(kind, cpu, memory, shm, shared_schemas, capsys):
    # A stranger trial: --memory 129e6, 1e3, +1Gi, .5, 2e-3 and 1n were "not a Kubernetes quantity".
    code = cli.main(["render-job", "--kind", kind, "--name", "j", "--nodes", "2", "--gpus-per-node", "8",
                     "--pvc", "c", "--cpu", cpu, "--memory", memory, "--shm-size", shm, "-o", "-"])
    assert code == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    job = yaml.load(text, Loader=_KubectlLoader)  # as kubectl reads it: 2e-3 unquoted would be a float
    crd = "kubeflow.org_pytorchjobs.yaml" if kind == "pytorchjob" else "trainer.kubeflow.org_trainjobs.yaml"
    schema = crd_schema.load_crd_schema(shared_schemas / crd, "v1" if kind == "pytorchjob" else "v1alpha1")
    assert crd_schema.schema_errors(job, schema) == []
    found = {"cpu": [], "memory": [], "shm": []}

    def walk(node):
        if isinstance(node, dict):
            if "limits" in node:
                found["cpu"].append(node["limits"]["cpu"])
                found["memory"].append(node["limits"]["memory"])
            if "sizeLimit" in node:
                found["shm"].append(node["sizeLimit"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(job)
    assert found["cpu"] and set(found["cpu"]) == {cpu} and set(found["memory"]) == {memory}
    assert set(found["shm"]) == {shm}


@pytest.mark.parametrize(("text", "value"), [
    ("1e3", 1000), ("+1Gi", 2**30), (".5", Fraction(1, 2)), ("5.", 5), ("2e-3", Fraction(2, 1000)),
    ("1n", Fraction(1, 10**9)), ("1u", Fraction(1, 10**6)), ("1E", 10**18), ("1E3", 1000), ("1e+3", 1000),
    ("-1", -1), ("129e6", 129 * 10**6), ("0.5Ki", 512), ("1e-2147483648", None),
])
def test_quantity_reads_the_kubernetes_grammar(text, value):
    from resilient_training.launch import jobshape

    assert jobshape.is_quantity(text)
    if value is None:  # tiny, not zero (Kubernetes rounds it up to 1n), and computed at once
        assert 0 < jobshape.quantity(text) < Fraction(1, 10**30)
    else:
        assert jobshape.quantity(text) == value


@pytest.mark.parametrize("text", ["", "e3", "1e", "1e+", ".", "+", "1.2.3", "1Gi3", "1ki", " 1", "1e1.5", "1_0",
                                  "\u0661", "1KiB", "0x10", "1e2147483648", "1e-2147483649"])
def test_quantity_refuses_what_kubernetes_cannot_parse(text):
    from resilient_training.launch import jobshape

    assert not jobshape.is_quantity(text)


def test_an_empty_trainer_image_variable_is_named(tmp_path):
    # A stranger trial: RT_TRAINER_IMAGE='' gave "image must be ... got ''" without naming the variable.
    env = {**os.environ, "RT_TRAINER_IMAGE": ""}
    proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", "render-job", "--name", "j", "--nodes",
                           "1", "--gpus-per-node", "8", "--pvc", "c", "-o", str(tmp_path / "j.yaml")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert "$RT_TRAINER_IMAGE" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "j.yaml").exists()


def test_trainer_arguments_stay_strings_for_kubectl(capsys):
    # As --cpu 2e-3: PyYAML wrote the argument 1e-05 bare, which kubectl reads as a number (args are strings).
    code = cli.main(["render-job", "--name", "j", "--nodes", "1", "--gpus-per-node", "8", "--pvc", "c", "--lr", "1e-5",
                     "-o", "-"])
    assert code == 0
    job = yaml.load(capsys.readouterr().out, Loader=_KubectlLoader)
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert all(isinstance(arg, str) for arg in container["args"]) and "1e-05" in container["args"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (it reads the file offline)")
@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_strings_kubectl_would_read_as_booleans_or_numbers_are_quoted(kind, tmp_path, capsys):
    """A stranger trial: --nodes 1 --pvc y (claimName: True), --namespace n, --run-id 0X1F, --env DEBUG=n,
    --env MASK=0o17 and --node-selector gpu=Y were written bare; kubectl (go-yaml v2) refused the file
    ("cannot unmarshal bool into … labels") or took 0o17 for 15."""
    out = tmp_path / "j.yaml"
    code = cli.main(["render-job", "--kind", kind, "--name", "y", "--namespace", "n", "--run-id", "0X1F", "--nodes", "1",
                     "--gpus-per-node", "8", "--pvc", "y", "--env", "DEBUG=n", "--env", "MASK=0o17", "--env", "B=0B1",
                     "--node-selector", "gpu=on", "--toleration", "dedicated=N:NoSchedule", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    read = subprocess.run(["kubectl", "label", "--local", "-f", str(out), "checked=1", "-o", "json"],
                          capture_output=True, text=True, timeout=60)
    assert read.returncode == 0, read.stderr
    text = read.stdout
    for value in ('"n"', '"0X1F"', '"y"', '"0o17"', '"0B1"', '"on"', '"N"'):
        assert value in text, (value, text[:3000])


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_worker_pods_ask_for_no_istio_sidecar(kind, shared_schemas, capsys):
    """A stranger trial: in a Kubeflow profile's namespace Istio injects a sidecar, which keeps a pod
    running after the trainer exits (the job never completes): the Training Operator's docs ask for
    sidecar.istio.io/inject "false" on the pods, and no job carried it."""
    code = cli.main(["render-job", "--kind", kind, "--name", "j", "--nodes", "2", "--gpus-per-node", "8", "--pvc", "c",
                     "-o", "-"])
    assert code == 0
    job = yaml.safe_load(capsys.readouterr().out)
    if kind == "pytorchjob":
        template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        schema = crd_schema.load_crd_schema(shared_schemas / "kubeflow.org_pytorchjobs.yaml")
    else:
        (patch,) = job["spec"]["runtimePatches"]
        (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        template = replicated["template"]["spec"]["template"]
        schema = crd_schema.load_crd_schema(shared_schemas / "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1")
    assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert crd_schema.schema_errors(job, schema) == []
