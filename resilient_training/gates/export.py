"""Export a validated checkpoint in a format other tools load: DCP, torch, safetensors, Hugging Face.

``export(RUN, step=N, fmt=..., out=PATH)``:

- ``dcp``: a copy of the step directory (DCP files, ``.metadata`` and our ``manifest.json``);
- ``torch``: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``: one ``torch.save``
  file of the whole state (``{"model": ..., "optim": ..., ...}``, full tensors);
- ``safetensors``: one file of the model's full tensors under the plain ``model.state_dict()``
  names, which ``safetensors.torch.load_file`` reads and ``load_state_dict(strict=True)`` takes;
- ``hf``: for a task whose model is a ``transformers.PreTrainedModel``: ``save_pretrained`` of the
  task's model with the checkpoint's weights (and the task's tokenizer when it has one), which
  ``AutoModelForCausalLM.from_pretrained`` loads.

Export refuses a checkpoint that did not pass ``validate-checkpoint`` in its run, or that changed
since (the validation record names it by its manifest's digest), and re-checks every file's bytes
against the manifest before reading it. Output is atomic (written beside ``PATH`` under a hidden
name, renamed into place) and never overwrites anything; a repeated export of the same checkpoint
to the same place is a no-op (``export.json`` in a directory, the header metadata of a
safetensors file record what was exported).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from resilient_training.gates import promote
from resilient_training.run import checkpoint_format as cf
from resilient_training.run import layout
from resilient_training.run.config import EXPORT_FORMATS
from resilient_training.run.paths import check_writable, probe_writable

FORMATS = EXPORT_FORMATS
# What each format's writer imports: the promote step's image must hold it (checked before a run).
MODULES: dict[str, tuple[str, ...]] = {"dcp": (), "torch": ("torch",), "safetensors": ("torch", "safetensors"),
                                       "hf": ("torch", "transformers", "safetensors")}
RECORD_NAME = "export.json"
STAGING_PREFIX = ".tmp-export-"


class ExportUsageError(ValueError):
    """The run, step or output cannot be used as given (exit code 2); nothing was written."""


class ExportRefused(RuntimeError):
    """The checkpoint did not pass validation, or changed since (exit code 1); nothing was written."""


def resolve(run: str | os.PathLike[str], step: int | None) -> Path:
    """``RUN/checkpoints/step_N`` (``step``) or the run's latest; ``run`` may also be a step directory."""
    path = Path(run)
    if not path.is_dir():
        raise ExportUsageError(f"{path} is not a directory" if path.exists() else f"{path} does not exist")
    if cf.parse_step_dirname(path.name) is not None and path.parent.name == layout.CHECKPOINTS_DIRNAME:
        if step is not None and cf.parse_step_dirname(path.name) != step:
            raise ExportUsageError(f"{path} is step {cf.parse_step_dirname(path.name)}, not --step {step}")
        return path
    root = layout.checkpoints_dir(path)
    if not root.is_dir():
        raise ExportUsageError(f"{path} is not a run (no {layout.CHECKPOINTS_DIRNAME}/)")
    if step is not None:
        if step < 0:
            raise ExportUsageError(f"--step must be >= 0, got {step}")
        committed = cf.committed_steps(root)
        if step not in committed:
            have = ", ".join(map(str, committed)) or "none"
            raise ExportUsageError(f"{path} has no committed checkpoint at step {step} (committed steps: {have})")
        return root / cf.step_dirname(step)
    try:
        latest = cf.read_latest(root)
    except cf.CheckpointError as exc:
        raise ExportRefused(str(exc)) from None
    if latest is None:
        raise ExportUsageError(f"{path} has no committed checkpoint")
    return latest


def export(run: str | os.PathLike[str], *, fmt: str, out: str | os.PathLike[str], step: int | None = None
           ) -> dict[str, Any]:
    """Export the validated checkpoint (see the module doc); returns what was written."""
    if fmt not in FORMATS:
        raise ExportUsageError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if not str(out).strip():
        raise ExportUsageError("the output path is empty")
    try:  # the output's own problems are bad input (exit 2), found before the gates are read
        check_writable(out, "-o", directory=fmt in ("dcp", "hf"))
    except ValueError as exc:
        raise ExportUsageError(str(exc)) from None
    out = Path(out)
    ckpt_dir = resolve(run, step)
    _refuse_inside_run(out, ckpt_dir.parent.parent)
    parent = out.absolute().parent
    if not parent.exists():  # export makes no directories (OUT appears by one rename, whole or not at all)
        raise ExportUsageError(f"-o {out}: {parent} does not exist: create it first")
    if not out.exists() and not out.is_symlink():  # no earlier export to find there: bad input comes first
        _probe(out)
    try:
        record = promote.check_validated(ckpt_dir)
    except promote.PromotionRefused as exc:
        raise ExportRefused(str(exc)) from None
    record = {"format": fmt, "source": record["source"], "task": record["manifest"].get("task"),
              "task_args": record["manifest"].get("task_args"), "files": record["files"], "exported_at": time.time()}
    names = [name for name in record["files"] if not isinstance(name, str) or Path(name).name != name
             or name in ("", ".", "..")]
    if names:  # a manifest naming paths outside its own directory (forged along with its record)
        raise ExportRefused(f"{ckpt_dir / cf.MANIFEST_NAME} lists files outside the checkpoint: {names[:3]}")
    _refuse_inside_run(out, Path(record["source"]["run_dir"]))  # the run that validated it, if moved since
    _refuse_inside_promoted(out, fmt, record)
    try:
        with promote.destination_lock(out, record):
            if _already_exported(out, fmt, record, ckpt_dir):
                return _outcome(out, fmt, record, already=True)
            _write(ckpt_dir, out, fmt, record)
    except promote.PromotionRefused as exc:
        raise ExportRefused(str(exc)) from None
    except promote.PromotionUsageError as exc:
        raise ExportUsageError(str(exc)) from None
    return _outcome(out, fmt, record, already=False)


def _write(ckpt_dir: Path, out: Path, fmt: str, record: dict[str, Any]) -> None:
    """Write OUT through a staging name beside it (the destination's lock held)."""
    parent = out.absolute().parent
    _probe(out)
    _verify_files(ckpt_dir, record)
    for stale in parent.glob(f"{STAGING_PREFIX}{out.name}-*"):  # a crashed export's (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    staging = parent / f"{STAGING_PREFIX}{out.name}-{os.getpid()}"
    try:
        WRITERS[fmt](ckpt_dir, staging, record)
        umask = os.umask(0)
        os.umask(umask)
        for path in [*staging.rglob("*"), staging] if staging.is_dir() else [staging]:
            if path.is_file():  # safetensors creates its files private (0600): give them the usual mode
                path.chmod(0o666 & ~umask)
        if staging.is_dir():
            cf.fsync_dir(staging)
            staging.rename(out)  # atomic: OUT appears complete or not at all (an empty directory is replaced)
        else:
            os.link(staging, out)  # never replaces a file another writer put there meanwhile (rename would)
            staging.unlink()
        cf.fsync_dir(parent)
    except FileExistsError:
        raise ExportRefused(f"{out} appeared while this export was written (by something other than an export "
                            "or promotion): nothing was replaced") from None
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and exc.filename and Path(exc.filename).is_relative_to(ckpt_dir):
            raise ExportRefused(f"{ckpt_dir} changed while it was exported ({exc.filename} is gone): nothing was "
                                "exported") from None
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and out.exists():
            raise ExportRefused(f"{out} appeared while this export was written (by something other than an "
                                "export or promotion): nothing was replaced") from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True) if staging.is_dir() else staging.unlink(missing_ok=True)


def _probe(out: Path) -> None:
    try:  # check_writable's access() says yes to root on /proc, where the staging file cannot be made
        probe_writable(out, "-o")
    except ValueError as exc:
        raise ExportUsageError(str(exc)) from None


def _refuse_inside_run(out: Path, run_dir: Path) -> None:
    """A run's records are the gates' evidence: no export lands there, this run's or another's (a
    stranger trial's export into another run's events/ made its convergence gate fail and
    delete its record, and one into its checkpoints/ a committed-looking step there).
    """
    for run in dict.fromkeys(r for r in (run_dir, layout.run_dir_around(out)) if r is not None):
        if inside := layout.evidence_holding(run, out):
            whose = "the run's" if run == run_dir else f"the run {run}'s"
            raise ExportUsageError(f"{out} lies inside {whose} {inside} (the gates' evidence): export elsewhere")


def _refuse_inside_promoted(out: Path, fmt: str, record: dict[str, Any]) -> None:
    """No export lands inside a promoted model but its own (``DEST/model.safetensors``, ...): any
    other file there makes the promotion's verified no-op refuse it (stranger trial). Its own is
    the export of the very checkpoint promoted there (its ``promotion.json`` names this manifest's
    digest): another run's model written as ``DEST/model.pt`` was VALID there (a stranger trial).
    """
    resolved = Path(os.path.abspath(out))
    parent = promote.promoted_model_above(resolved)
    if parent is None:
        return
    if parent == resolved.parent and PROMOTED_NAMES.get(fmt) == resolved.name:  # promote_model's export option
        try:
            promoted = cf.read_json_object(parent / promote.PROMOTION_NAME)
            source = promoted.get("source")
            digest = source.get("manifest_checksum") if isinstance(source, dict) else None
        except (OSError, cf.CheckpointError) as exc:
            raise ExportUsageError(f"{out} lies inside the promoted model {parent}, whose record cannot be read "
                                   f"({exc}): export beside it") from None
        if digest == record["source"]["manifest_checksum"]:
            return  # the export of the checkpoint promoted there, under the name promotion expects
        step = source.get("step") if isinstance(source, dict) else None
        raise ExportUsageError(f"{out} lies inside the promoted model {parent} of another checkpoint (step {step} of "
                               f"{source.get('run_dir') if isinstance(source, dict) else None}; this is step "
                               f"{record['source']['step']} of {record['source']['run_dir']}): export beside it")
    raise ExportUsageError(f"{out} lies inside the promoted model {parent}: export beside it (only "
                           f"{', '.join(PROMOTED_NAMES.values())} directly inside, as promote_model writes)")


def _outcome(out: Path, fmt: str, record: dict[str, Any], *, already: bool) -> dict[str, Any]:
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.is_dir() else out.stat().st_size
    return {"out": str(out), "format": fmt, "step": record["source"]["step"], "bytes": size,
            "checkpoint": str(Path(record["source"]["run_dir"]) / record["source"]["checkpoint"]),
            "already_exported": already}


def _already_exported(out: Path, fmt: str, record: dict[str, Any], ckpt_dir: Path) -> bool:
    """True when ``out`` holds this very export, byte for byte; refuses to touch anything else there.

    The record names the checkpoint but vouches for no byte of the export (a stranger trial
    flipped a weight, or put another run's file there, and got "already exported"): the export is
    made again beside ``out`` and compared (torch's file has no record: only the comparison).
    """
    if not out.exists() and not out.is_symlink():
        return False
    existing: Any = {"format": fmt, "source": record["source"]} if fmt == "torch" and out.is_file() else None
    if fmt in ("dcp", "hf") and (out / RECORD_NAME).is_file():
        try:
            existing = json.loads((out / RECORD_NAME).read_text())
        except (OSError, json.JSONDecodeError, RecursionError):
            existing = None
    elif fmt == "safetensors" and out.is_file():
        existing = safetensors_record(out)
    if isinstance(existing, dict) and existing.get("format") == fmt and isinstance(existing.get("source"), dict) \
            and existing["source"].get("manifest_checksum") == record["source"]["manifest_checksum"]:
        if _same_as_fresh_export(out, fmt, record, ckpt_dir):
            return True
        raise ExportUsageError(f"{out} already exists and is not byte for byte this checkpoint's {fmt} export "
                               "(damaged or changed since): refusing to overwrite it; remove it and export again")
    raise ExportUsageError(f"{out} already exists (and is not this export of this checkpoint): refusing to overwrite it")


def promoted_export_differs(dest: Path, fmt: str, source: dict[str, Any], manifest: dict[str, Any],
                            scratch: Path) -> bool:
    """True when the export ``promote_model`` wrote inside a promoted ``dest`` is not byte for byte
    what exporting ``dest``'s checkpoint makes now (made in ``scratch``, which validation owns:
    ``dest`` is not written). ``source`` is the export's own record of it, whose manifest digest
    the caller checked. ExportUsageError when it cannot be made here (e.g. no transformers).
    """
    record = {"format": fmt, "source": source, "task": manifest.get("task"), "task_args": manifest.get("task_args"),
              "files": manifest["files"]}
    return not _same_as_fresh_export(dest / PROMOTED_NAMES[fmt], fmt, record, dest, scratch=scratch)


def _same_as_fresh_export(out: Path, fmt: str, record: dict[str, Any], ckpt_dir: Path,
                          scratch: Path | None = None) -> bool:
    """``out`` has the bytes an export of ``ckpt_dir`` made now has (the record file aside: it
    holds the time it was made). Exports are deterministic; the cost is one more export, made
    beside ``out`` or in ``scratch``.
    """
    import filecmp

    # a crash's leftover beside out: export cleans it
    fresh = (scratch or out.parent) / f"{STAGING_PREFIX}{out.name}-verify{os.getpid()}"
    shutil.rmtree(fresh, ignore_errors=True) if fresh.is_dir() else fresh.unlink(missing_ok=True)
    try:
        _verify_files(ckpt_dir, record)
        WRITERS[fmt](ckpt_dir, fresh, record)

        def files(root: Path) -> dict[str, Path] | None:
            if root.is_symlink() or not (root.is_file() or root.is_dir()):
                return None
            if root.is_file():
                return {"": root}
            found = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if not p.is_dir() or p.is_symlink()}
            if any(p.is_symlink() or not p.is_file() for p in found.values()):
                return None  # a link's bytes live elsewhere and can change
            found.pop(RECORD_NAME, None)
            return found

        have, want = files(out), files(fresh)
        safetensors = fmt == "safetensors"
        return have is not None and want is not None and have.keys() == want.keys() and all(
            _same_safetensors(have[name], want[name]) if safetensors or name.endswith(".safetensors")
            else filecmp.cmp(have[name], want[name], shallow=False) for name in want)
    finally:
        shutil.rmtree(fresh, ignore_errors=True) if fresh.is_dir() else fresh.unlink(missing_ok=True)


def _same_safetensors(a: Path, b: Path) -> bool:
    """The same safetensors content: the library writes its header's maps in no fixed order (two
    exports of one checkpoint differ there), so the headers are compared as JSON, the data as bytes.
    """
    import filecmp
    import struct

    def header(path: Path) -> tuple[int, Any]:
        with open(path, "rb") as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            if size > 100 << 20:
                raise ValueError("header too large")
            return 8 + size, json.loads(handle.read(size))

    try:
        (start_a, head_a), (start_b, head_b) = header(a), header(b)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return filecmp.cmp(a, b, shallow=False)
    if head_a != head_b or a.stat().st_size - start_a != b.stat().st_size - start_b:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.seek(start_a)
        fb.seek(start_b)
        while chunk := fa.read(1 << 24):
            if chunk != fb.read(len(chunk)):
                return False
    return True


def verify_promoted_exports(dest: Path, ckpt_dir: Path) -> None:
    """Each export ``promote_model`` wrote inside a promoted ``dest`` is this checkpoint's, byte for
    byte (ExportRefused otherwise): the file a consumer loads is checked like the checkpoint's.
    """
    try:
        checked = promote.check_validated(ckpt_dir)
    except promote.PromotionRefused as exc:
        raise ExportRefused(str(exc)) from None
    for fmt, name in PROMOTED_NAMES.items():
        out = dest / name
        if not out.exists() and not out.is_symlink():
            continue
        record = {"format": fmt, "source": checked["source"], "task": checked["manifest"].get("task"),
                  "task_args": checked["manifest"].get("task_args"), "files": checked["files"]}
        try:
            _already_exported(out, fmt, record, ckpt_dir)
        except ExportUsageError as exc:
            raise ExportRefused(str(exc)) from None


def safetensors_record(path: Path) -> dict[str, Any] | None:
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        return {"format": "safetensors", "source": json.loads(metadata.get("source", "null"))}
    except Exception:
        return None


def _verify_files(ckpt_dir: Path, record: dict[str, Any]) -> None:
    """Every file the manifest lists still has its recorded bytes (damage after validation)."""
    for name, entry in sorted(record["files"].items()):
        try:
            hasher, size = cf.new_hasher(), 0
            with promote.open_source(ckpt_dir / name) as handle:  # a FIFO there is refused, never waited on
                while block := handle.read(16 << 20):
                    hasher.update(block)
                    size += len(block)
            digest = hasher.hexdigest()
        except promote.PromotionRefused as exc:
            raise ExportRefused(str(exc)) from None
        except OSError as exc:
            raise ExportRefused(f"{ckpt_dir / name} cannot be read: {exc.strerror or exc}") from None
        if size != entry["bytes"] or digest != entry["checksum"]:
            raise ExportRefused(f"{ckpt_dir / name} no longer matches its manifest ({size} bytes, {digest}; manifest "
                                f"{entry['bytes']} bytes, {entry['checksum']}): damaged after validation")


def model_state(ckpt_dir: Path) -> dict[str, Any]:
    """The model's full tensors under the plain ``model.state_dict()`` names, read through DCP in one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = cf.reader(ckpt_dir)  # DCP's FileSystemReader, chunks read straight into the tensors
    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    others = []
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith("model."):
            continue
        if isinstance(entry, TensorStorageMetadata):
            state[key.removeprefix("model.")] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            others.append(key)
    if others:
        raise ExportRefused(f"{ckpt_dir}: the model state holds non-tensor values ({', '.join(others[:3])}), "
                            "which a tensor file cannot hold")
    if not state:
        raise ExportRefused(f"{ckpt_dir} holds no model tensors")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return state


def _write_record(directory: Path, record: dict[str, Any]) -> None:
    with open(directory / RECORD_NAME, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(record, indent=1, sort_keys=True, allow_nan=True))
        handle.flush()
        os.fsync(handle.fileno())


def _write_dcp(ckpt_dir: Path, staging: Path, record: dict[str, Any]) -> None:
    staging.mkdir()
    for name in [*sorted(record["files"]), cf.MANIFEST_NAME]:
        size, digest = promote._copy_hashing(ckpt_dir / name, staging / name)
        expected = (record["source"]["manifest_checksum"] if name == cf.MANIFEST_NAME
                    else record["files"][name]["checksum"])
        if digest != expected:
            raise ExportRefused(f"{ckpt_dir / name} changed while being exported")
    _write_record(staging, record)


def _write_torch(ckpt_dir: Path, staging: Path, record: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # torch's archive names its records after the file, up to the name's last dot: the staging name
    # (OUT's, with "-PID" or "-verifyPID") gave the same prefix in both, but an OUT without a suffix
    # left only a leading dot, which torch refuses (a stranger trial's RuntimeError). Written in a
    # folder of its own under a name made from OUT's alone (the prefix as before where OUT has a
    # suffix), then moved: an export and its verification have the same bytes.
    out_name = staging.name.removeprefix(STAGING_PREFIX).rpartition("-")[0]
    folder = staging.with_name(f"{staging.name}.d")
    folder.mkdir()
    written = folder / f"{STAGING_PREFIX}{out_name}{'-x' if '.' in out_name else '.pt'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_to_torch_save(str(ckpt_dir), str(written))
    with open(written, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(written, staging)
    folder.rmdir()


def _write_safetensors(ckpt_dir: Path, staging: Path, record: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    state = {name: tensor.contiguous() for name, tensor in model_state(ckpt_dir).items()}
    # Header metadata is str -> str: what was exported, from where (also how a repeat is recognised).
    save_file(state, str(staging), metadata={"format": "pt", "source": json.dumps(record["source"], sort_keys=True),
                                             "task": str(record["task"]),
                                             "task_args": json.dumps(record["task_args"], sort_keys=True)})
    with open(staging, "rb") as handle:
        os.fsync(handle.fileno())


def build_task_model(record: dict[str, Any]) -> tuple[Any, Any]:
    """(task, model) of the run's task with the checkpoint's recorded settings (random weights)."""
    import torch

    from resilient_training.runtime import task as tk

    spec, args = record["task"], record["task_args"] or {}
    if not isinstance(spec, str) or not isinstance(args, dict):
        raise ExportRefused("the checkpoint's manifest names no task: cannot build its model")
    generator_state = torch.random.get_rng_state()
    try:
        task = tk.load_task(spec, {str(k): str(v) for k, v in args.items()})
        return task, tk.build_model(task)
    except tk.TaskError as exc:
        raise ExportUsageError(f"the run's task cannot be built here: {exc}") from None
    finally:
        torch.random.set_rng_state(generator_state)


def hf_export_problem(task: str, task_args: dict[str, Any]) -> str | None:
    """Why ``--format hf`` cannot export this task's model, found before any training (its model
    built on the meta device), or None (also when the task itself cannot be built: its own
    pre-flight says so). A third stranger trial's `run --export hf` trained and promoted first.
    """
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "--format hf needs transformers (pip install 'resilient-training[llama]')"
    import torch

    from resilient_training.runtime import task as tk

    try:
        with torch.device("meta"):
            _, model = build_task_model({"task": task, "task_args": task_args})
    except (ExportRefused, ExportUsageError):
        return None
    problem = tk.export_refusal(task, model, "hf")
    return f"{problem}: export it with safetensors or torch" if problem else None


def _write_hf(ckpt_dir: Path, staging: Path, record: dict[str, Any]) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ExportUsageError("--format hf needs transformers (pip install 'resilient-training[llama]')") from None
    from resilient_training.runtime import task as tk

    try:
        with tk.cannot_exit("the run's task"):  # an exit there would read as a finished export
            _write_hf_model(ckpt_dir, staging, record)
    except tk.TaskError as exc:
        raise ExportUsageError(f"the run's task cannot be built here: {exc}") from None


def _write_hf_model(ckpt_dir: Path, staging: Path, record: dict[str, Any]) -> None:
    from resilient_training.runtime import task as tk

    task, model = build_task_model(record)
    if problem := tk.export_refusal(record["task"], model, "hf"):
        raise ExportUsageError(f"{problem}: export it with --format safetensors (or torch, dcp)")
    from transformers.utils import logging as hf_logging

    model.load_state_dict(model_state(ckpt_dir), strict=True)
    staging.mkdir()
    hf_logging.disable_progress_bar()  # one line of output, not a progress bar on stderr
    model.save_pretrained(str(staging))
    if callable(getattr(task, "tokenizer", None)):
        task.tokenizer().save_pretrained(str(staging))
    for path in staging.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    _write_record(staging, record)


WRITERS = {"dcp": _write_dcp, "torch": _write_torch, "safetensors": _write_safetensors, "hf": _write_hf}

# Where ``promote_model(export=FMT)`` puts the export inside the promoted DEST (itself a DCP checkpoint).
PROMOTED_NAMES = dict(zip(("torch", "safetensors", "hf"), promote.EXPORTS_INSIDE_DEST, strict=True))


def export_promoted(checkpoint: str | os.PathLike[str], dest: str, fmt: str, *, s3_client: Any = None
                    ) -> dict[str, Any]:
    """After ``promote(checkpoint, dest)``: the same checkpoint exported as ``fmt`` into ``DEST/<name>``.

    ``dcp`` adds nothing (DEST already is the DCP checkpoint). For ``s3://`` the export is written
    locally first, then uploaded file by file; a repeat overwrites the same bytes.
    """
    if fmt == "dcp":
        return {"out": dest, "format": fmt, "already_exported": True}
    if fmt not in PROMOTED_NAMES:
        raise ExportUsageError(f"export {fmt!r}: choose one of {', '.join(FORMATS)} (or empty for none)")
    ckpt_dir = promote.resolve_checkpoint(checkpoint)
    if not dest.startswith("s3://"):
        return export(ckpt_dir.parent.parent, fmt=fmt, out=Path(dest) / PROMOTED_NAMES[fmt],
                      step=cf.parse_step_dirname(ckpt_dir.name))
    import tempfile

    bucket, prefix = promote.parse_s3(dest)
    client = s3_client or promote.new_s3_client()  # every request bounded in time, as promote's
    with tempfile.TemporaryDirectory() as scratch:
        local = Path(scratch) / PROMOTED_NAMES[fmt]
        outcome = export(ckpt_dir.parent.parent, fmt=fmt, out=local, step=cf.parse_step_dirname(ckpt_dir.name))
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        for path in files:
            key = "/".join(filter(None, (prefix, path.relative_to(scratch).as_posix())))
            client.upload_file(str(path), bucket, key)
    return {**outcome, "out": f"{dest.rstrip('/')}/{PROMOTED_NAMES[fmt]}"}
