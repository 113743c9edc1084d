"""The built-in Llama task: real text as byte tokens, a global sample position, and a loss that falls."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from resilient_training.tasks import llama, text


def write_files(root: Path, contents: dict[str, bytes]) -> list[Path]:
    for name, body in contents.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
    return text.glob_files(str(root / "**" / "*.txt"))


def test_the_stream_is_every_file_s_bytes_each_followed_by_end_of_text(tmp_path):
    files = write_files(tmp_path, {"b.txt": b"world", "a.txt": b"hello", "sub/c.txt": b"", "d.txt": b"\xff!"})
    corpus = text.ByteCorpus(files, source="test")
    assert [f.name for f in corpus.files] == ["a.txt", "b.txt", "d.txt", "c.txt"]  # sorted by path
    expected = []
    for body in (b"hello", b"world", b"\xff!", b""):
        expected += [b + text.BYTE_OFFSET for b in body] + [text.EOS_ID]
    assert corpus.num_tokens == len(expected)
    assert corpus.tokens(0, len(expected)).tolist() == expected
    for start in range(len(expected)):  # every window, also those starting on or spanning an end-of-text
        for length in (1, 3, len(expected) - start):
            if start + length <= len(expected):
                assert corpus.tokens(start, length).tolist() == expected[start:start + length], (start, length)
    assert text.decode(corpus.tokens(0, 11)) == "hello" + "world"
    assert text.encode("hello").tolist() == expected[:5]


def test_the_default_corpus_is_this_interpreter_s_standard_library_without_site_packages():
    corpus = text.ByteCorpus.from_spec("")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert len(corpus.files) > 500 and corpus.num_tokens > 10_000_000
    assert all(f.is_relative_to(stdlib) and "site-packages" not in f.parts for f in corpus.files)
    assert stdlib / "json" / "decoder.py" in corpus.files


def test_a_glob_that_matches_nothing_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no text files in data="):
        text.ByteCorpus.from_spec(str(tmp_path / "*.txt"))
    (tmp_path / "x.txt").write_bytes(b"abc")
    with pytest.raises(ValueError, match="fewer than one sample"):
        llama.LlamaTask(data=str(tmp_path / "*.txt"), seq_len=8).build_data(0, 1, 0)


def batches(loader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_ranks_split_each_global_batch_and_a_resume_at_another_world_size_continues_at_the_same_sample(tmp_path):
    files = write_files(tmp_path, {f"f{i}.txt": bytes(range(40, 60)) * (i + 1) for i in range(6)})
    task = llama.LlamaTask(data=str(tmp_path / "*.txt"), seq_len=16, batch_size=2)
    # One rank with four samples per step reads what two ranks with two each read together.
    single = llama.LlamaTask(data=str(tmp_path / "*.txt"), seq_len=16, batch_size=4)
    reference = torch.cat(batches(single.build_data(0, 1, seed=7), 12))  # 48 samples: past one epoch
    assert len(files) == 6 and reference.shape == (48, 17)
    two = [task.build_data(rank, 2, seed=7) for rank in range(2)]
    iters = [iter(loader) for loader in two]
    seen = []
    for _ in range(3):
        seen += [next(it) for it in iters]
    assert torch.equal(torch.cat(seen), reference[:12])
    windows = text.TokenWindows(text.ByteCorpus(files, source="t"), seq_len=16, batch_size=1, rank=0,
                                world_size=1, seed=7)
    assert windows.num_samples < 48  # the reference crossed an epoch boundary: a new permutation
    assert sorted(windows.sample_index(p) for p in range(windows.num_samples)) == list(range(windows.num_samples))
    # Every rank's state is the same global position, so any of them resumes any new rank.
    states = [loader.state_dict() for loader in two]
    assert states[0]["dataset_state"] == states[1]["dataset_state"]
    assert states[0]["dataset_state"]["position"] == 12
    three = [task.build_data(rank, 3, seed=7) for rank in range(3)]
    for loader in three:
        loader.load_state_dict(states[1])
    iters3 = [iter(loader) for loader in three]
    resumed = []
    for _ in range(2):
        resumed += [next(it) for it in iters3]
    assert torch.equal(torch.cat(resumed), reference[12:24])


def test_a_resume_onto_other_data_or_another_seed_is_refused(tmp_path):
    write_files(tmp_path, {"a.txt": b"x" * 400})
    task = llama.LlamaTask(data=str(tmp_path / "*.txt"), seq_len=16, batch_size=2)
    loader = task.build_data(0, 1, seed=1)
    batches(loader, 2)
    state = loader.state_dict()
    other_seed = task.build_data(0, 1, seed=2)
    other_seed.load_state_dict(state)
    with pytest.raises(ValueError, match="data seed"):
        next(iter(other_seed))
    (tmp_path / "a.txt").write_bytes(b"x" * 401)  # the data changed under the run
    changed = task.build_data(0, 1, seed=1)
    changed.load_state_dict(state)
    with pytest.raises(ValueError, match="data corpus"):
        next(iter(changed))


@pytest.mark.parametrize(("args", "message"), [
    ({"preset": "7b"}, "choose one of"),
    ({"seq_len": "many"}, "seq_len='many' is not an int"),
    ({"lr": "0"}, "lr must be positive"),
    ({"num_heads": "3"}, "divisible by num_heads"),
    ({"batchsize": "4"}, "unknown task arg batchsize"),
])
def test_bad_task_args_are_one_clear_error(args, message):
    with pytest.raises(ValueError, match=message):
        llama.task(**args)


def test_task_args_arrive_as_strings_and_presets_span_cpu_tests_to_a_billion_parameters():
    task = llama.task(preset="tiny", seq_len="64", lr="0.002", num_layers="3")
    assert (task.seq_len, task.lr, task.sizes()["num_layers"]) == (64, 0.002, 3)
    from transformers import LlamaForCausalLM

    def params(preset: str) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(llama.LlamaTask(preset=preset).model_config()).parameters())

    assert 15e6 < params("20m") < 25e6
    assert params("1b") >= 1e9


@pytest.fixture
def one_thread():
    # Two intra-op threads on a shared 2-core machine spin against other processes: 20x slower steps.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("preset", "steps", "lr"), [("tiny", 40, 3e-3), ("20m", 20, 1e-3)])
def test_the_same_seed_builds_the_same_model_and_the_loss_falls_on_cpu(one_thread, preset, steps, lr):
    task = llama.LlamaTask(preset=preset, seq_len=64, batch_size=8, lr=lr)
    torch.manual_seed(3)
    model = task.build_model()
    torch.manual_seed(3)
    again = task.build_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    optimizer = task.build_optimizer(model)
    losses = []
    for batch in batches(task.build_data(0, 1, seed=0), steps):
        loss = task.loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 5.0  # ln(259) = 5.56: a random model knows nothing
    assert sum(losses[-5:]) / 5 < 0.65 * losses[0], losses


@pytest.mark.slow
def test_the_trainer_resumes_the_llama_task_at_another_world_size_at_the_same_global_sample(tmp_path_factory,
                                                                                           tmp_path):
    """2 ranks x 4 samples for 12 steps leave the position at sample 96; one rank then reads 96.. onwards."""
    from resilient_training.run import checkpoint_format as cf
    from tests.support.gates import copy_run
    from tests.support.runs import LLAMA_TINY, gated_llama_run, train

    run = copy_run(gated_llama_run(tmp_path_factory.getbasetemp()), tmp_path / "run")
    before = cf.load_data_state(run / "checkpoints" / "step_12", 1)
    assert before["dataset_state"]["position"] == 12 * 2 * 4
    resumed = train(run, "--steps", "16", "--checkpoint-every", "4", "--no-async-checkpoint", "--nproc", "1",
                    *LLAMA_TINY)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert any(e.event == "load_done" and e.step == 12 for e in resumed.events)
    after = cf.load_data_state(run / "checkpoints" / "step_16", 0)
    assert after["dataset_state"]["position"] == 96 + 4 * 1 * 4
    losses = [e["loss"] for e in resumed.events if e.event == "step"]
    assert losses[0] > 5.0 and losses[-1] < 0.8 * losses[0]  # the first run's and the resumed one's
