"""Integrity validation of committed checkpoints: re-read every byte, prove it loads.

:func:`validate` takes a run directory (validates what ``checkpoints/latest`` names, or every
committed checkpoint) or one ``step_N`` directory, and returns a :class:`ValidationReport` with
one :class:`Finding` per problem, each naming the file (and tensor) and what is wrong.
Temporary directories of saves in flight or killed mid-write are listed as ignored: the
commit protocol guarantees nothing loads them, so they are not corruption.

The stages, in order (a stage only looks at files the previous ones found whole):

1. layout: ``latest`` names a committed ``step_N``; the manifest parses (format 2: PyTorch DCP)
   and lists every rank's files and DCP's ``.metadata``; no unknown file sits beside them;
2. bytes: every file is read once in large blocks, in parallel threads (xxhash releases the
   GIL), and its size and xxh3_128 checksum compared with the manifest; the world size is the
   one the run's own event log recorded for this commit;
3. contents: ``.metadata`` loads through a restricted unpickler and agrees with the manifest;
   every tensor's chunks cover its full extent exactly (the proof that the whole state is
   there); every chunk loads with ``weights_only=True`` and matches its recorded shape, dtype
   and checksum, and is finite; optimizer values and data states load with ``weights_only=True``;
4. load: DCP loads the checkpoint into a fresh model and optimizer of the run's task in one
   process (resharding from the saved world size), strictly, and every loaded model value
   hashes the same as the chunk the trainer saved.

Only ``validate`` finds problems; it never repairs. A check it cannot make is a finding, never
a silent skip.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import time
from pathlib import Path
from typing import Any

from resilient_training.run import checkpoint_format as cf
from resilient_training.run import layout
from resilient_training.run.checkpoint_format import file_mismatch, hash_files

SUPPORTED_FORMATS = (cf.FORMAT_VERSION,)
MANIFEST_KEYS = ("format_version", "step", "world_size", "files", "tensors", "objects")
# Bounds on a manifest's numbers, checked before any is used (a stranger trial's world size of
# 10**30 was an OverflowError traceback): steps, as the trainer counts them; seeds, as torch takes them.
MAX_STEP = (1 << 63) - 1
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
# No file system names a file longer than this (bytes): a longer name in a manifest is no file of it.
MAX_NAME_BYTES = 255


class UsageError(ValueError):
    """The path given is not something validation can look at (exit code 2)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """One problem: a stable ``code``, the file it is in, and what is wrong."""

    code: str
    file: str
    message: str
    tensor: str | None = None

    def __str__(self) -> str:
        where = f"{self.file} [{self.tensor}]" if self.tensor else self.file
        return f"{self.code}: {where}: {self.message}"


@dataclasses.dataclass(slots=True)
class CheckpointResult:
    """What validating one committed checkpoint found."""

    path: str
    step: int | None = None
    world_size: int | None = None
    bytes: int = 0
    read_seconds: float = 0.0
    seconds: float = 0.0
    manifest_checksum: str | None = None
    findings: list[Finding] = dataclasses.field(default_factory=list)
    checks: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)  # checks not run on request (--no-load)

    @property
    def valid(self) -> bool:
        return not self.findings

    @property
    def full_check(self) -> bool:
        """Valid with every check run: what promotion requires."""
        return self.valid and not self.skipped

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["valid"] = self.valid
        data["full_check"] = self.full_check
        data["read_gbps"] = self.bytes / self.read_seconds / 1e9 if self.read_seconds else None
        return data


@dataclasses.dataclass(slots=True)
class ValidationReport:
    """The verdict on a run or a checkpoint."""

    target: str
    kind: str  # "run" | "checkpoint"
    checkpoints: list[CheckpointResult] = dataclasses.field(default_factory=list)
    findings: list[Finding] = dataclasses.field(default_factory=list)  # run-level (the latest pointer)
    ignored: list[dict[str, str]] = dataclasses.field(default_factory=list)

    @property
    def all_findings(self) -> list[Finding]:
        return self.findings + [f for c in self.checkpoints for f in c.findings]

    @property
    def valid(self) -> bool:
        return not self.all_findings and bool(self.checkpoints)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "kind": self.kind,
            "valid": self.valid,
            "findings": [dataclasses.asdict(f) for f in self.all_findings],
            "checkpoints": [c.to_dict() for c in self.checkpoints],
            "ignored": self.ignored,
        }


def resolve_target(path: str | os.PathLike[str]) -> tuple[str, Path]:
    """("run", RUN/checkpoints) or ("checkpoint", step_dir); UsageError for anything else."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    if not path.is_dir():
        raise UsageError(f"{path} is not a directory (expected a run directory or a checkpoints/step_N directory)")
    if (path / layout.CHECKPOINTS_DIRNAME).is_dir():
        return "run", path / layout.CHECKPOINTS_DIRNAME
    if path.name == layout.CHECKPOINTS_DIRNAME:
        return "run", path
    if (path / cf.MANIFEST_NAME).exists() or cf.parse_step_dirname(path.name) is not None:
        return "checkpoint", path
    raise UsageError(
        f"{path} is neither a run directory (no {layout.CHECKPOINTS_DIRNAME}/) nor a checkpoint (no {cf.MANIFEST_NAME})"
    )


def validate(
    path: str | os.PathLike[str],
    *,
    all_checkpoints: bool = False,
    load: bool = True,
    threads: int | None = None,
) -> ValidationReport:
    """Validate a run's latest checkpoint (or all committed ones), or one checkpoint directory."""
    kind, location = resolve_target(path)
    base = Path(path)
    report = ValidationReport(target=str(path), kind=kind)
    if kind == "checkpoint":
        report.checkpoints.append(validate_checkpoint_dir(location, display_base=base.parent, load=load,
                                                          threads=threads))
        return report
    targets = _scan_root(location, base, report, all_checkpoints=all_checkpoints)
    for ckpt in targets:
        report.checkpoints.append(validate_checkpoint_dir(ckpt, display_base=base, load=load, threads=threads))
    return report


def _rel(path: Path, base: Path) -> str:
    return os.path.relpath(path, base)


def _scan_root(root: Path, base: Path, report: ValidationReport, *, all_checkpoints: bool) -> list[Path]:
    """Check the ``latest`` pointer, classify every entry of ``checkpoints/``; return what to validate."""
    committed = cf.committed_steps(root)
    pointer = root / cf.LATEST_NAME
    latest: Path | None = None
    if not pointer.is_file():
        code = "latest_missing" if committed else "no_checkpoint"
        detail = (f"committed checkpoints exist ({', '.join(cf.step_dirname(s) for s in committed)}) but none is published"
                  if committed else "the run has no committed checkpoint")
        report.findings.append(Finding(code, _rel(pointer, base), detail))
    else:
        name = pointer.read_text(errors="replace").strip()
        if cf.parse_step_dirname(name) is None:
            report.findings.append(Finding("latest_invalid", _rel(pointer, base),
                                           f"names {name[:80]!r}, which is not a step_N directory"))
        elif not (root / name).is_dir():
            report.findings.append(Finding("latest_dangling", _rel(pointer, base), f"names {name}, which does not exist"))
        elif not (root / name / cf.MANIFEST_NAME).is_file():
            report.findings.append(Finding("latest_uncommitted", _rel(root / name, base),
                                           f"latest names {name}, which has no {cf.MANIFEST_NAME} (never committed)"))
        else:
            latest = root / name
    for child in sorted(root.iterdir()):
        if child.name == cf.LATEST_NAME or (latest is not None and child == latest):
            continue
        rel = _rel(child, base)
        step = cf.parse_step_dirname(child.name)
        if child.name.startswith(cf.TMP_PREFIX):
            partial = sorted(p.name for p in child.glob("*.partial")) if child.is_dir() else []
            reason = "uncommitted: a save in flight or abandoned by a crash; never loaded"
            if partial:
                reason += f" (holds {', '.join(partial)})"
            report.ignored.append({"path": rel, "reason": reason})
        elif step is not None and child.is_dir() and not (child / cf.MANIFEST_NAME).is_file():
            report.ignored.append({"path": rel, "reason": f"uncommitted: no {cf.MANIFEST_NAME}; never loaded"})
        elif step is not None and child.is_dir():
            if not all_checkpoints:
                newer = latest is not None and step > (cf.parse_step_dirname(latest.name) or 0)
                why = ("committed but newer than latest (a crash fell between commit and publish)" if newer
                       else "older committed checkpoint (validate it with --all)")
                report.ignored.append({"path": rel, "reason": why})
        else:
            report.ignored.append({"path": rel, "reason": "not part of the checkpoint layout"})
    if all_checkpoints:
        return [root / cf.step_dirname(s) for s in committed]
    return [latest] if latest is not None else []


def validate_checkpoint_dir(
    ckpt_dir: str | os.PathLike[str],
    *,
    display_base: str | os.PathLike[str] | None = None,
    load: bool = True,
    threads: int | None = None,
) -> CheckpointResult:
    """Run every check on one committed checkpoint directory."""
    started = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    base = Path(display_base) if display_base is not None else ckpt_dir.parent
    result = CheckpointResult(path=_rel(ckpt_dir, base))
    try:
        _Checker(ckpt_dir, base, result, load=load, threads=threads).run()
    finally:
        result.seconds = time.perf_counter() - started
    return result


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: its dataclasses, ``torch.Size`` and dtypes.

    DCP writes ``.metadata`` with plain pickle; a tampered file could name any callable, so
    validation resolves only the classes DCP's metadata consists of.
    """

    METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # its dataclasses and enums
    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == self.METADATA_MODULE:
            found = super().find_class(module, name)
            if isinstance(found, type):  # never a function
                return found
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


def read_dcp_metadata(path: Path) -> Any:
    """DCP's ``.metadata`` through :class:`_MetadataUnpickler` (never arbitrary objects)."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(path, "rb") as handle:
        metadata = _MetadataUnpickler(handle).load()
    if not isinstance(metadata, Metadata):
        raise cf.CheckpointError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def _names_remote_code(path: Path) -> bool:
    """A JSON file of an hf folder with an ``auto_map`` (the classes transformers loads as code)."""
    try:  # never waited on: a FIFO there hung validation (cf.read_regular_bytes)
        data = json.loads(cf.read_regular_bytes(path))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "auto_map" in data


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry_problem(kind: str, entry: Any) -> str | None:
    """What is wrong with the shape of a manifest's tensor or value entry (None: nothing)."""
    def stored(item: Any) -> bool:
        return isinstance(item.get("file"), str) and _int(item.get("offset")) and _int(item.get("length"))

    def ints(value: Any) -> bool:
        return isinstance(value, list) and all(map(_int, value))

    if not isinstance(entry, dict):
        return f"is a {type(entry).__name__}, not an object"
    if kind == "objects":
        return None if stored(entry) else "lacks its file, offset or length (a string and two integers)"
    if not ints(entry.get("size")) or not isinstance(entry.get("dtype"), str):
        return "lacks its size (a list of integers) or its dtype"
    chunks = entry.get("chunks")
    if not isinstance(chunks, list) or not all(isinstance(c, dict) and ints(c.get("offsets")) and ints(c.get("sizes"))
                                               and stored(c) for c in chunks):
        return "has chunks that are not a list of objects with offsets, sizes, file, offset and length"
    return None


class _Checker:
    def __init__(self, ckpt_dir: Path, base: Path, result: CheckpointResult, *, load: bool, threads: int | None):
        self.dir = ckpt_dir
        self.base = base
        self.result = result
        self.load = load
        self.threads = threads
        self.manifest: dict[str, Any] = {}
        self.expected_ranks: list[int] = []
        self.expected_files: dict[str, int] = {}  # file name -> rank
        self.whole: set[str] = set()  # files whose bytes match the manifest
        self.metadata: Any = None
        self.promoted_source: dict[str, Any] | None = None  # a promoted model's, once its record vouched

    def where(self, name: str) -> str:
        return _rel(self.dir / name, self.base)

    def find(self, code: str, name: str, message: str, tensor: str | None = None) -> None:
        self.result.findings.append(Finding(code, self.where(name), message, tensor))

    def run(self) -> None:
        if self.dir.is_symlink():  # the trainer never makes one: its files live wherever the link leads
            self.find("not_a_regular_file", ".", f"the checkpoint directory is a symbolic link (to "
                      f"{os.readlink(self.dir)}): a committed checkpoint is a directory of its own run")
        if not self.check_manifest():
            return
        self.check_files()
        self.check_bytes()
        self.check_commit()
        if not self.check_metadata():
            return
        covered = self.check_coverage()
        self.check_chunks()
        self.check_objects_and_data()
        # A checkpoint with findings is not loaded: they already say why it is invalid.
        if self.load and covered and not self.result.findings:
            self.check_load()
            from resilient_training.run.gate_records import run_dir_of

            if not self.result.findings and run_dir_of(self.dir) is None and self._promoted_extras():
                self.check_exports_bytes()
        elif not self.load:
            self.result.skipped.append("load into a freshly built model (--no-load)")

    # 1. layout ---------------------------------------------------------------------------
    def check_manifest(self) -> bool:
        name = cf.MANIFEST_NAME
        path = self.dir / name
        if not path.is_file():
            self.find("manifest_missing", name, "no manifest: the checkpoint was never committed")
            return False
        if path.is_symlink():
            self.find("not_a_regular_file", name, f"the manifest is a symbolic link (to {os.readlink(path)}): "
                      "a committed checkpoint holds its own files")
            return False
        try:
            manifest = json.loads(cf.read_regular_bytes(path))
        except OSError as exc:  # a FIFO in its place is never waited on (cf.read_regular_bytes)
            self.find("manifest_invalid", name, f"cannot be read: {exc.strerror or exc}")
            return False
        except (ValueError, UnicodeDecodeError) as exc:  # ValueError: also an integer of over 4300 digits
            self.find("manifest_invalid", name, f"not valid JSON: {exc}"[:300])
            return False
        except RecursionError:
            self.find("manifest_invalid", name, "not valid JSON: nested too deeply")
            return False
        if not isinstance(manifest, dict):
            self.find("manifest_invalid", name, f"holds a {type(manifest).__name__}, not an object")
            return False
        if manifest.get("format_version") == 1:
            self.find("format_unsupported", name, "format_version 1 (rank_N.pt shards, before PyTorch DCP) is no "
                      f"longer read; this version validates format {cf.FORMAT_VERSION} only: train a new run")
            return False
        missing = [k for k in MANIFEST_KEYS if k not in manifest]
        if missing:
            self.find("manifest_incomplete", name, f"lacks {', '.join(missing)}")
            return False
        if manifest["format_version"] not in SUPPORTED_FORMATS:
            self.find("format_unsupported", name, f"format_version {manifest['format_version']!r} is not one of "
                      f"{SUPPORTED_FORMATS}")
            return False
        if not isinstance(manifest["world_size"], int) or isinstance(manifest["world_size"], bool) \
                or manifest["world_size"] < 1:
            self.find("manifest_incomplete", name, f"world_size {manifest['world_size']!r} is not a positive integer")
            return False
        if not all(isinstance(manifest[k], dict) for k in ("files", "tensors", "objects")):
            self.find("manifest_invalid", name, "files, tensors and objects must be objects")
            return False
        if not _int(manifest["step"]) or not 0 <= manifest["step"] <= MAX_STEP:
            self.find("manifest_invalid", name, f"step {repr(manifest['step'])[:40]} is not an integer from 0 to "
                      f"{MAX_STEP}")
            return False
        seed = manifest.get("seed", 0)
        if not _int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:  # the load seeds torch with it
            self.find("manifest_invalid", name, f"seed {repr(seed)[:40]} is not an integer torch takes as a seed")
            return False
        long_names = [n for n in manifest["files"] if len(n.encode(errors="replace")) > MAX_NAME_BYTES]
        if long_names:  # (its digits were a ValueError traceback past 4300)
            self.find("manifest_invalid", name, f"lists a file name of {len(long_names[0].encode(errors='replace'))} "
                      f"bytes ({long_names[0][:40]}...): no file system names a file that long")
            return False
        ranks = manifest.get("ranks")
        if ranks is not None and (not isinstance(ranks, list) or not ranks
                                  or not all(isinstance(r, int) and 0 <= r < manifest["world_size"] for r in ranks)):
            self.find("manifest_invalid", name, f"ranks {ranks!r} are not ranks of world size {manifest['world_size']}")
            return False
        # Every rank it holds has a file of its own (its data state): a world size past the files
        # listed is no checkpoint's (a stranger trial's 10**12 ranks was a MemoryError, 10**6 ranks
        # two million findings, 10**30 an OverflowError: no range of it is made before this bound).
        if (len(ranks) if ranks else manifest["world_size"]) > len(manifest["files"]):
            self.find("manifest_invalid", name, f"world_size {manifest['world_size']} but it lists "
                      f"{len(manifest['files'])} files: every rank holds at least its data state")
            return False
        malformed = [(f"{kind} entry {key}", problem) for kind in ("tensors", "objects")
                     for key, entry in manifest[kind].items() if (problem := _entry_problem(kind, entry))]
        if malformed:  # read field by field below (a string in their place was a traceback)
            (first, problem), more = malformed[0], len(malformed) - 1
            self.find("manifest_invalid", name, f"{first} {problem}" + (f" (and {more} more)" if more else ""))
            return False
        # The trainer steps the optimizer and the data loader once per step: a checkpoint of
        # step N holds optimizer step N and data position N, or its parts are from different steps.
        for key, code in (("optimizer_step", "optimizer_step_mismatch"), ("data_position", "data_position_mismatch")):
            if manifest.get(key) != manifest["step"]:
                self.find(code, name, f"{key} {manifest.get(key)!r} but step {manifest['step']}: model, optimizer "
                          "and data state are from different steps")
        dir_step = cf.parse_step_dirname(self.dir.name)
        if dir_step is not None and dir_step != manifest["step"]:
            self.find("step_mismatch", name, f"manifest step {manifest['step']} but the directory is {self.dir.name}")
        from resilient_training.run.gate_records import manifest_digest

        self.manifest = manifest
        # A node-local tier checkpoint holds only this node's ranks (manifest "ranks").
        self.expected_ranks = list(ranks or range(manifest["world_size"]))
        self.expected_files = {cf.METADATA_NAME: self.expected_ranks[0]}
        # A rank writes DCP files __R_0 ... __R_{N-1} (N write threads): the highest index the
        # manifest lists for the rank says how many (never more than it lists files); a gap is a
        # missing file.
        files = manifest["files"]
        last: dict[int, int] = {}
        for found in filter(None, map(cf.shard_rank_index, files)):
            last[found[0]] = max(found[1], last.get(found[0], 0))
        for rank in self.expected_ranks:
            for index in range(min(last.get(rank, 0) + 1, len(files))):
                self.expected_files[cf.shard_name(rank, index)] = rank
            self.expected_files[cf.data_name(rank)] = rank
        self.result.step = manifest["step"]
        self.result.world_size = manifest["world_size"]
        self.result.manifest_checksum = manifest_digest(self.dir)
        self.result.checks.append("manifest parses and is complete")
        return True

    def check_files(self) -> None:
        """Every rank's files listed and present, nothing else; findings name what is missing or extra."""
        files = self.manifest["files"]
        ok = True
        for name, rank in self.expected_files.items():
            entry = files.get(name)
            if not isinstance(entry, dict):
                self.find("manifest_incomplete", cf.MANIFEST_NAME, f"does not list {name} (rank {rank}'s)")
                ok = False
                continue
            if entry.get("rank") != rank:
                self.find("rank_mismatch", cf.MANIFEST_NAME, f"lists {name} as rank {entry.get('rank')!r}")
                ok = False
            if (self.dir / name).is_symlink():  # its bytes live elsewhere and can change after the gates ran
                self.find("not_a_regular_file", name, f"rank {rank}'s file is a symbolic link (to "
                          f"{os.readlink(self.dir / name)}): a committed checkpoint holds its own files")
                ok = False
            elif not (self.dir / name).is_file():
                self.find("shard_missing", name, f"rank {rank}'s file is missing")
                ok = False
        for name in sorted(set(files) - set(self.expected_files)):
            self.find("manifest_incomplete", cf.MANIFEST_NAME,
                      f"lists {name}, which is no file of the ranks {self.expected_ranks} of world size "
                      f"{self.manifest['world_size']}")
            ok = False
        # A promoted model directory (promote's copy) also holds its promotion record and the
        # exports promote_model wrote inside it; check_commit judges the record.
        allowed = {cf.MANIFEST_NAME, *self._promoted_extras()}
        for child in sorted(self.dir.iterdir()):
            if child.name not in self.expected_files and child.name not in allowed:
                self.find("unexpected_file", child.name, "unknown file inside a committed checkpoint")
                ok = False
        exports = self._check_promoted_exports() if self._promoted_extras() else ""
        if ok:
            self.result.checks.append(f"the files of all {len(self.expected_ranks)} ranks, DCP's .metadata and the "
                                      f"manifest present, nothing else{exports}")

    def check_exports_bytes(self) -> None:
        """promote_model's exports inside a promoted directory hold this checkpoint's weights, byte
        for byte: each is made again (in a temporary directory) and compared, as promote does on a
        repeat (a stranger trial's flipped weight in model.safetensors was VALID here while promote
        refused it, and another run's model.pt, which records nothing, written into a promoted model
        by `export -o` was VALID). The safetensors and hf records were checked in the layout stage.
        """
        import tempfile

        from resilient_training.gates.export import (
            PROMOTED_NAMES,
            RECORD_NAME,
            ExportRefused,
            ExportUsageError,
            promoted_export_differs,
            safetensors_record,
        )

        compared = []
        for fmt in ("torch", "safetensors", "hf"):
            name = PROMOTED_NAMES[fmt]
            path = self.dir / name
            if not path.exists():
                continue
            try:
                if fmt == "torch":  # it records nothing: made again from the checkpoint promotion.json vouched for
                    record: Any = {"source": self.promoted_source}
                elif fmt == "safetensors":
                    record = safetensors_record(path)
                else:
                    record = cf.read_json_object(path / RECORD_NAME)  # read in the layout stage: a regular file
                with tempfile.TemporaryDirectory(prefix="rt-validate-export-") as scratch:
                    differs = promoted_export_differs(self.dir, fmt, record["source"], self.manifest, Path(scratch))
            except ExportUsageError as exc:
                self.result.skipped.append(f"{name} compared byte for byte with a fresh export ({exc})")
                continue
            except (ExportRefused, OSError, cf.CheckpointError, TypeError, KeyError) as exc:
                self.find("export_invalid", name, f"promote_model's {fmt} export could not be made again to compare "
                          f"with it: {exc}"[:600])
                continue
            if differs:
                self.find("export_invalid", name, f"promote_model's {fmt} export is not byte for byte what exporting "
                          "this checkpoint makes (changed since it was written)")
            else:
                compared.append(name)
        if compared:
            self.result.checks.append(f"{' and '.join(compared)} byte for byte what exporting this checkpoint makes")

    def _check_promoted_exports(self) -> str:
        """promote_model's exports inside a promoted directory must be this checkpoint's: a
        safetensors file's or an hf folder's own record names this manifest's digest, and an hf
        folder holds no Python (transformers runs a model folder's code with trust_remote_code;
        no export writes any). torch's file records nothing: the full check compares it byte
        for byte. Returns what the check line adds (a stranger trial planted all three and read
        "nothing else").
        """
        from resilient_training.gates.export import PROMOTED_NAMES, RECORD_NAME, safetensors_record

        present = []
        for fmt, name in PROMOTED_NAMES.items():
            path = self.dir / name
            if not path.exists() and not path.is_symlink():
                continue
            present.append(name)
            record: Any = None
            if fmt == "safetensors" and path.is_file() and not path.is_symlink():
                record = safetensors_record(path)
            elif fmt == "hf" and path.is_dir() and not path.is_symlink():
                code = sorted(str(p.relative_to(self.dir)) for p in path.rglob("*.py"))
                if code:
                    self.find("export_invalid", name, f"holds Python code ({', '.join(code[:3])}), which no export "
                              "writes: transformers would run it with trust_remote_code")
                links = sorted(str(p.relative_to(self.dir)) for p in path.rglob("*") if p.is_symlink())
                if links:  # its bytes live elsewhere (a stranger trial's hf/model.safetensors -> /etc/passwd)
                    self.find("export_invalid", name, f"holds symbolic links ({', '.join(links[:3])}), which no "
                              "export writes")
                remote = sorted(str(p.relative_to(self.dir)) for p in path.glob("*.json") if _names_remote_code(p))
                if remote:  # no export writes one: it makes transformers fetch a model's code from the Hub
                    self.find("export_invalid", name, f"{', '.join(remote)} names code to run (auto_map), which no "
                              "export writes: transformers would fetch and run it with trust_remote_code")
                try:  # a regular file, never waited on (a FIFO there hung validation)
                    record = cf.read_json_object(path / RECORD_NAME)
                except (OSError, cf.CheckpointError):
                    record = None
            elif fmt == "torch" and path.is_file() and not path.is_symlink():
                continue  # no record inside: compared byte for byte with a fresh export (check_exports_bytes)
            source = record.get("source") if isinstance(record, dict) else None
            recorded = source.get("manifest_checksum") if isinstance(source, dict) else None
            if recorded != self.result.manifest_checksum:
                why = (f"records the manifest digest {recorded}, not this one's" if recorded
                       else "is not an export of ours (no readable record of its source)")
                self.find("export_invalid", name, f"promote_model's {fmt} export {why}")
        if not present:
            return ""
        return (f"; exports {', '.join(present)} (safetensors and hf record this manifest's digest; model.pt "
                "records nothing: the full check compares it byte for byte)")

    # 2. bytes ----------------------------------------------------------------------------
    def check_bytes(self) -> None:
        names = [n for n in self.expected_files if isinstance(self.manifest["files"].get(n), dict)
                 and (self.dir / n).is_file() and not (self.dir / n).is_symlink()]
        paths = [self.dir / n for n in names]
        start = time.perf_counter()
        hashed = hash_files(paths, self.threads) if paths else {}
        self.result.read_seconds = time.perf_counter() - start
        for name, path in zip(names, paths, strict=True):
            outcome = hashed[path]
            if not isinstance(outcome, OSError):
                self.result.bytes += outcome[0]
            found = file_mismatch(outcome, self.manifest["files"][name])
            if found is None:
                self.whole.add(name)
            elif found[0] == "checksum_mismatch" and not isinstance(outcome, OSError):
                self.find(found[0], name, f"{found[1]}: {self.manifest.get('checksum_algorithm', cf.CHECKSUM_ALGORITHM)} "
                          f"{outcome[1]}, the manifest records {self.manifest['files'][name].get('checksum')}")
            else:
                self.find(found[0], name, found[1])
        if len(self.whole) == len(self.expected_files):
            self.result.checks.append(f"sizes and checksums of {self.result.bytes} bytes match the manifest")

    def check_commit(self) -> None:
        """The checkpoint is the one the run committed at this step, with the ranks it trained with.

        The run's own event log is the independent witness: rank 0 logs each commit with the
        world size and the digest of the manifest it wrote. A checkpoint copied in from another
        run, or rewritten since with every checksum re-recorded, is otherwise self-consistent;
        so is a manifest rewritten for fewer ranks (one rank's files deleted).
        """
        from resilient_training.run import gate_records

        run_dir = gate_records.run_dir_of(self.dir)
        if run_dir is None and self._promoted_extras():
            self.check_promotion()
            return
        if self.manifest.get("ranks") is not None:
            if run_dir is None:
                return  # a node-local tier checkpoint: its tier is never validated through a run
            # A run commits only full checkpoints under checkpoints/: this key had switched the
            # event-log check off, and another run's step with it added was promoted (stranger trial).
            self.find("not_committed_by_run", cf.MANIFEST_NAME,
                      f"the manifest lists ranks {self.manifest['ranks']!r} (a node-local tier checkpoint's), "
                      f"but a run commits only checkpoints of every rank under {layout.CHECKPOINTS_DIRNAME}/")
            return
        if run_dir is None:
            self.find("world_size_unverified", cf.MANIFEST_NAME, "the checkpoint lies outside a run directory: "
                      "no event log to prove it holds every rank the run trained with")
            return
        from resilient_training.gates.promote import run_uid_problem

        # The manifest's run_uid against the run's (what `train` refuses to resume): a stranger trial
        # promoted another run's step copied in with its gate records. Said once with the commit below.
        uid_problem = run_uid_problem(run_dir, self.manifest)
        step = self.manifest["step"]
        commit, recorded, source = gate_records.recorded_commit(run_dir, step)
        if recorded is None:
            self.find("world_size_unverified", cf.MANIFEST_NAME,
                      f"{source}: cannot prove the checkpoint holds every rank the run trained with")
        elif recorded != self.manifest["world_size"]:
            self.find("world_size_mismatch", cf.MANIFEST_NAME,
                      f"world size {self.manifest['world_size']}, but the run committed step {step} "
                      f"with {recorded} ranks ({source}): ranks are missing")
        else:
            self.result.checks.append(f"world size {recorded} is the one the run committed this step with ({source})")
        if commit is None:  # said above: no commit of this step in the log
            if uid_problem:
                self.find(uid_problem[0], cf.MANIFEST_NAME, f"the checkpoint {uid_problem[1]}")
            return
        logged = commit.get("manifest_checksum")
        if not isinstance(logged, str):
            self.find("commit_unverified", cf.MANIFEST_NAME,
                      f"the run's event log records the commit of step {step} without its manifest digest "
                      "(written by an older version): cannot prove this is the checkpoint the run committed")
        elif logged != self.result.manifest_checksum:
            self.find("not_committed_by_run", cf.MANIFEST_NAME,
                      f"manifest digest {self.result.manifest_checksum}, but the run committed step {step} with "
                      f"manifest digest {logged}: this is not the checkpoint the run saved (copied from another "
                      "run, or rewritten after its commit)" + (f"; it {uid_problem[1]}" if uid_problem else ""))
            return
        elif not uid_problem:
            uid = "; its run_uid is this run directory's" if self.manifest.get("run_uid") is not None else ""
            self.result.checks.append(f"the manifest is the one the run committed at step {step} (its digest is "
                                      f"in the run's event log{uid})")
        if uid_problem:
            self.find(uid_problem[0], cf.MANIFEST_NAME, f"the checkpoint {uid_problem[1]}")

    def _promoted_extras(self) -> tuple[str, ...]:
        """The names a promoted model directory holds besides the checkpoint (none elsewhere)."""
        from resilient_training.gates.promote import EXPORTS_INSIDE_DEST, PROMOTION_NAME
        from resilient_training.run import gate_records

        if not (self.dir / PROMOTION_NAME).is_file() or gate_records.run_dir_of(self.dir) is not None:
            return ()
        return (PROMOTION_NAME, *EXPORTS_INSIDE_DEST)

    def check_promotion(self) -> None:
        """Outside its run, a promoted copy is proven by its promotion record instead of the event
        log: the record names this manifest's digest, with the run's passing validation (which
        checked the world size against the run's event log) and convergence of that same manifest.
        A checkpoint rewritten after promotion, or a record copied from another promotion, differs.
        """
        from resilient_training.gates.promote import PROMOTION_NAME

        digest = self.result.manifest_checksum
        try:
            record = cf.read_json_object(self.dir / PROMOTION_NAME)  # a regular file, never waited on
            source, validation, convergence = record["source"], record["validation"], record["convergence"]
            validated = validation["checkpoints"][source["checkpoint"]]
            recorded = source["manifest_checksum"]
        except (OSError, cf.CheckpointError, KeyError, TypeError):
            self.find("promotion_invalid", PROMOTION_NAME, "is not a readable promotion record (source, validation "
                      "and convergence of the promoted checkpoint): cannot prove which checkpoint this is")
            return
        if recorded != digest:
            self.find("not_the_promoted_checkpoint", cf.MANIFEST_NAME,
                      f"manifest digest {digest}, but {PROMOTION_NAME} promoted the manifest with digest {recorded}: "
                      "this checkpoint was changed after its promotion, or the record belongs to another")
            return
        problems = [what for what, gate, passed in (
            ("validation", validated, isinstance(validated, dict) and validated.get("valid") is True),
            ("convergence", convergence, isinstance(convergence, dict) and convergence.get("passed") is True))
            if not passed or not isinstance(gate, dict) or gate.get("manifest_checksum") != digest]
        if problems:
            self.find("promotion_invalid", PROMOTION_NAME,
                      f"does not record a passed {' and '.join(problems)} of this manifest (digest {digest})")
            return
        self.promoted_source = source
        self.result.checks.append(
            f"world size {self.manifest['world_size']} and manifest are those validated in run "
            f"{source.get('run_dir')} at {source['checkpoint']} before promotion ({PROMOTION_NAME} records this "
            "manifest's digest with passed validation and convergence)")

    # 3. contents -------------------------------------------------------------------------
    def check_metadata(self) -> bool:
        """DCP's ``.metadata`` loads (restricted) and agrees with the manifest, entry for entry."""
        name = cf.METADATA_NAME
        if name not in self.whole:
            return False
        try:
            self.metadata = read_dcp_metadata(self.dir / name)
        except Exception as exc:  # any unpickling failure means the same thing here
            self.find("metadata_invalid", name, f"is not DCP metadata: {exc}"[:300])
            return False
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        md = self.metadata.state_dict_metadata
        storage = self.metadata.storage_data or {}
        tensors, objects = self.manifest["tensors"], self.manifest["objects"]
        ok = True
        md_tensors = {k for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
        md_objects = {k for k, v in md.items() if isinstance(v, BytesStorageMetadata)}
        for fqn in sorted(md_tensors ^ set(tensors)):
            where = "the manifest" if fqn in tensors else ".metadata"
            self.find("metadata_mismatch", name, f"tensor only in {where}", fqn)
            ok = False
        for fqn in sorted(md_objects ^ set(objects)):
            where = "the manifest" if fqn in objects else ".metadata"
            self.find("metadata_mismatch", name, f"value only in {where}", fqn)
            ok = False
        places: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
        for index, info in storage.items():
            offset = tuple(index.offset) if index.offset is not None else None
            places[(index.fqn, offset)] = (info.relative_path, info.offset, info.length)
        for fqn in sorted(md_tensors & set(tensors)):
            meta, entry = md[fqn], tensors[fqn]
            if list(meta.size) != entry.get("size") or cf.dtype_name(meta.properties.dtype) != entry.get("dtype"):
                self.find("metadata_mismatch", name, f"size {list(meta.size)} {meta.properties.dtype} but the manifest "
                          f"records {entry.get('size')} {entry.get('dtype')}", fqn)
                ok = False
                continue
            recorded = {(tuple(c["offsets"]), tuple(c["sizes"]), (c["file"], c["offset"], c["length"]))
                        for c in entry.get("chunks", [])}
            actual = {(tuple(c.offsets), tuple(c.sizes), places.get((fqn, tuple(c.offsets)))) for c in meta.chunks}
            if recorded != actual or len(meta.chunks) != len(entry.get("chunks", [])):
                self.find("metadata_mismatch", name, f"{len(meta.chunks)} chunks in .metadata differ from the "
                          f"manifest's {len(entry.get('chunks', []))} (offsets, sizes or where they are stored)", fqn)
                ok = False
        for fqn in sorted(md_objects & set(objects)):
            entry = objects[fqn]
            if places.get((fqn, None)) != (entry.get("file"), entry.get("offset"), entry.get("length")):
                self.find("metadata_mismatch", name, "stored elsewhere than the manifest records", fqn)
                ok = False
        if ok:
            self.result.checks.append(f"DCP .metadata ({len(md_tensors)} tensors, {len(md_objects)} values) agrees "
                                      "with the manifest")
        return ok

    def check_coverage(self) -> bool:
        """Every tensor's chunks tile its full extent: in bounds, no overlap, nothing missing.

        This is what proves the checkpoint holds the whole model and optimizer state, whatever
        the files and the manifest say about ranks.
        """
        ok = True
        incomplete: list[tuple[str, str]] = []
        for fqn, entry in self.manifest["tensors"].items():
            size = entry["size"]
            total = math.prod(size)
            boxes = [(c["offsets"], c["sizes"]) for c in entry["chunks"] if math.prod(c["sizes"])]
            bad = [b for b in boxes if len(b[0]) != len(size) or len(b[1]) != len(size)
                   or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(b[0], b[1], size, strict=True))]
            if bad:
                self.find("coverage_invalid", cf.METADATA_NAME, f"chunk at {bad[0][0]} of size {bad[0][1]} lies "
                          f"outside the tensor's {size}", fqn)
                ok = False
                continue
            for i, (a_off, a_size) in enumerate(boxes):
                for b_off, b_size in boxes[i + 1:]:
                    if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size,
                                                                                     strict=True)):
                        self.find("coverage_invalid", cf.METADATA_NAME, f"chunks at {a_off} and {b_off} overlap", fqn)
                        ok = False
                        break
                else:
                    continue
                break
            covered = sum(math.prod(s) for _, s in boxes)
            if covered != total:
                incomplete.append((fqn, f"chunks cover {covered} of {total} elements (size {size})"))
        if incomplete:
            # One problem (part of the state is in no file), one finding: count, and name the first.
            self.find("coverage_incomplete", cf.METADATA_NAME, f"{len(incomplete)} tensors are not fully covered by "
                      f"their chunks, so part of the state is in no file; first: {incomplete[0][1]}", incomplete[0][0])
            ok = False
        if ok:
            self.result.checks.append(f"every tensor's chunks cover its full extent exactly "
                                      f"({len(self.manifest['tensors'])} tensors)")
        return ok

    def _read(self, file: str, offset: int, length: int) -> bytes | None:
        """Bytes of one stored item, if its file is whole and the range lies inside it."""
        entry = self.manifest["files"].get(file)
        if file not in self.whole or file == cf.METADATA_NAME or not isinstance(entry, dict):
            return None
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 < length
                and offset + length <= entry["bytes"]):
            return None
        with open(self.dir / file, "rb") as handle:
            handle.seek(offset)
            return handle.read(length)

    def check_chunks(self) -> None:
        """Each chunk loads (``weights_only=True``) with its recorded shape, dtype and checksum, finite."""
        import torch

        from resilient_training.run.checkpoint_format import tensor_checksum

        problems = 0
        non_finite: list[tuple[str, str, str]] = []
        grouped: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (code, file) -> [(tensor, message)]
        count = 0

        def note(code: str, file: str, message: str, fqn: str) -> None:
            grouped.setdefault((code, file), []).append((fqn, message))
        for fqn, entry in self.manifest["tensors"].items():
            for chunk in entry["chunks"]:
                count += 1
                file = chunk.get("file", "?")
                if file not in self.whole:
                    if file not in self.expected_files:
                        note("chunk_unreadable", cf.MANIFEST_NAME, f"stored in {file}, no file of this checkpoint", fqn)
                        problems += 1
                    continue  # its file already has a finding
                data = self._read(file, chunk.get("offset"), chunk.get("length"))
                if data is None:
                    note("chunk_unreadable", file, f"bytes {chunk.get('offset')}+{chunk.get('length')} lie outside "
                         "the file", fqn)
                    problems += 1
                    continue
                try:
                    tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                except Exception as exc:
                    note("chunk_unreadable", file, f"does not load with weights_only=True: {exc}"[:300], fqn)
                    problems += 1
                    continue
                if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != chunk["sizes"] \
                        or cf.dtype_name(tensor.dtype) != entry["dtype"]:
                    what = f"{list(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else \
                        type(tensor).__name__
                    note("tensor_mismatch", file, f"chunk at {chunk['offsets']} holds {what}, expected "
                         f"{chunk['sizes']} {entry['dtype']}", fqn)
                    problems += 1
                    continue
                if tensor_checksum(tensor) != chunk.get("checksum"):
                    note("tensor_checksum_mismatch", file, f"chunk at {chunk['offsets']}: values differ from the "
                         "ones the trainer saved (per-chunk checksum)", fqn)
                    problems += 1
                    continue
                if (tensor.is_floating_point() or tensor.is_complex()) and tensor.numel() \
                        and not torch.isfinite(tensor.sum()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    if bad:
                        nans = int(torch.isnan(tensor).sum())
                        non_finite.append((file, fqn, f"{bad} of {tensor.numel()} values are not finite "
                                           f"({nans} NaN, {bad - nans} inf)"))
                        problems += 1
        for (code, file), found in grouped.items():
            # One finding per problem and file: a shard from another step is one problem, not 100.
            more = f" ({len(found)} chunks; first: {found[0][0]})" if len(found) > 1 else ""
            self.find(code, file, found[0][1] + more, found[0][0])
        by_file: dict[str, list[tuple[str, str]]] = {}
        for file, fqn, message in non_finite:
            by_file.setdefault(file, []).append((fqn, message))
        for file, found in by_file.items():
            if len(found) == 1:
                self.find("non_finite", file, found[0][1], found[0][0])
                continue
            # One problem (the state diverged), one finding per file: name the first chunks, count the rest.
            listed = ", ".join(f for f, _ in found[:4]) + (", ..." if len(found) > 4 else "")
            self.find("non_finite", file, f"{len(found)} chunks hold non-finite values ({listed}); first: "
                      f"{found[0][1]}", found[0][0])
        if not problems and all(f in self.whole for f in self.expected_files):
            self.result.checks.append(f"all {count} chunks load with weights_only=True and match the manifest's shape, "
                                      "dtype and checksum; every floating value is finite")

    def check_objects_and_data(self) -> None:
        """Non-tensor values (optimizer hyperparameters, scheduler) and every rank's data state load
        with ``weights_only=True``; the optimizer's state names only parameters the model has.
        """
        import torch

        problems = 0
        for fqn, entry in self.manifest["objects"].items():
            data = self._read(entry.get("file", "?"), entry.get("offset"), entry.get("length"))
            if data is None:
                if entry.get("file") in self.whole:
                    self.find("chunk_unreadable", entry.get("file", "?"), "stored bytes lie outside the file", fqn)
                problems += 1
                continue
            try:
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as exc:
                self.find("object_unreadable", entry["file"], f"does not load with weights_only=True: {exc}"[:300], fqn)
                problems += 1
        for rank in self.expected_ranks:
            name = cf.data_name(rank)
            if name not in self.whole:
                problems += 1
                continue
            try:
                cf.load_data_state(self.dir, rank)
            except Exception as exc:
                self.find("data_state_invalid", name, f"does not load with weights_only=True: {exc}"[:300])
                problems += 1
        recorded = self.manifest.get("data_state")
        if not isinstance(recorded, dict) or sorted(recorded) != sorted(str(r) for r in self.expected_ranks):
            self.find("data_state_invalid", cf.MANIFEST_NAME, f"data_state does not list the ranks {self.expected_ranks}")
            problems += 1
        params = {k.removeprefix("model.") for k in self.manifest["tensors"] if k.startswith("model.")}
        orphans = sorted(k for k in (*self.manifest["tensors"], *self.manifest["objects"])
                         if k.startswith("optim.state.") and not any(k.startswith(f"optim.state.{p}.") for p in params))
        if orphans:
            self.find("optimizer_state_mismatch", cf.METADATA_NAME, f"optimizer state for a parameter the model lacks "
                      f"({len(orphans)} entries)", orphans[0])
            problems += 1
        if not problems:
            self.result.checks.append(f"optimizer values and the data state of all {len(self.expected_ranks)} ranks "
                                      "load with weights_only=True; optimizer state pairs with model parameters")

    # 4. load -----------------------------------------------------------------------------
    def check_load(self) -> None:
        """:meth:`_check_load`, where the task's code cannot end the process (its exit would read
        as this gate's verdict).
        """
        from resilient_training.runtime import task as tk

        try:
            with tk.cannot_exit("the run's task"):
                self._check_load()
        except tk.TaskError as exc:
            self.find("load_failed", cf.MANIFEST_NAME, f"{exc}"[:600])

    def _check_load(self) -> None:
        """Load the checkpoint through DCP into a freshly built model, optimizer (and scheduler) of the
        run's task, in this one process (world size 1: DCP's reader reshards from the saved world
        size), strictly both ways, and prove every loaded model value hashes the same as the chunk
        the trainer saved.

        The fresh optimizer's state (initialised as ``get_state_dict`` does) names every state
        tensor a resume needs: a checkpoint lacking one fails here, whatever the manifest says.
        """
        import torch
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from resilient_training.run.checkpoint_format import tensor_checksum
        from resilient_training.runtime.checkpointing import flat_state, state_dict

        built = self._fresh()
        if built is None:
            return
        model, optimizer, scheduler = built
        try:
            state = state_dict(model, optimizer, scheduler)
        except Exception as exc:
            self.find("load_failed", cf.MANIFEST_NAME, f"the task's optimizer state cannot be initialised: {exc}"[:600])
            return
        expected = set(flat_state(state)[0])
        stored = set(self.manifest["tensors"]) | set(self.manifest["objects"])
        missing, extra = sorted(expected - stored), sorted(stored - expected)
        if missing or extra:
            detail = (f"lacks {len(missing)} entries a fresh model and optimizer of the task have (first {missing[0]})"
                      if missing else f"holds {len(extra)} entries the task's model and optimizer lack (first {extra[0]})")
            self.find("load_failed", cf.MANIFEST_NAME, f"does not load strictly: {detail}")
            return
        try:
            cf.dcp_load(state, self.dir)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            if scheduler is not None:
                scheduler.load_state_dict(state["lr_scheduler"])
        except Exception as exc:
            self.find("load_failed", cf.MANIFEST_NAME, f"does not load into a fresh model and optimizer: {exc}"[:600])
            return
        world = self.manifest["world_size"]
        self.result.checks.append(f"loads strictly into a fresh model and optimizer of the run's task in one process "
                                  f"(world size 1, resharded by DCP from {world})")
        saved = {k.removeprefix("model."): v for k, v in self.manifest["tensors"].items() if k.startswith("model.")}
        for fqn, tensor in model.state_dict().items():
            for chunk in saved[fqn]["chunks"]:
                region = tensor
                for dim, (offset, size) in enumerate(zip(chunk["offsets"], chunk["sizes"], strict=True)):
                    region = region.narrow(dim, offset, size)
                if tensor_checksum(region.contiguous() if isinstance(region, torch.Tensor) else region) \
                        != chunk["checksum"]:
                    self.find("load_hash_mismatch", chunk["file"], "the tensor loaded into the model does not hash "
                              "the same as the saved chunk", f"model.{fqn}")
                    return
        self.result.checks.append(f"every loaded model tensor hashes the same as the chunks saved by {world} ranks")

    def _fresh(self) -> tuple[Any, Any, Any] | None:
        import torch

        from resilient_training.runtime import task as tk

        spec = self.manifest.get("task")
        args = self.manifest.get("task_args") or {}
        if not isinstance(spec, str) or not isinstance(args, dict):
            self.find("manifest_incomplete", cf.MANIFEST_NAME, "lacks task/task_args: cannot build a model to load into")
            return None
        state = torch.random.get_rng_state()
        torch.manual_seed(int(self.manifest.get("seed", 0)))
        try:
            task = tk.load_task(spec, {str(k): str(v) for k, v in args.items()})
            model = tk.build_model(task)
            optimizer = tk.build_optimizer(task, model)
            return model, optimizer, tk.lr_scheduler(task, optimizer)
        except tk.TaskError as exc:
            self.find("load_failed", cf.MANIFEST_NAME, f"the run's task builds no model here: {exc}"[:600])
            return None
        finally:
            torch.random.set_rng_state(state)


def check_recordable(path: str | os.PathLike[str]) -> None:
    """UsageError when ``path``'s run could not take the validation record (see gate_records)."""
    from resilient_training.run import gate_records

    kind, location = resolve_target(path)
    run_dir = location.parent if kind == "run" else gate_records.run_dir_of(location)
    if run_dir is not None:
        try:
            gate_records.check_recordable(run_dir, gate_records.VALIDATION)
        except gate_records.RecordError as exc:
            raise UsageError(str(exc)) from None


def write_validation_record(path: str | os.PathLike[str], report: ValidationReport) -> Path | None:
    """Record the verdict in ``RUN/gates/validation.json`` (when the target lies in a run).

    An invalid verdict is recorded too: it replaces an earlier pass, so promotion refuses.
    """
    from resilient_training.run import gate_records

    kind, location = resolve_target(path)
    run_dir = location.parent if kind == "run" else gate_records.run_dir_of(location)
    if run_dir is None:
        return None
    checkpoints = {}
    for ckpt in report.checkpoints:
        ckpt_dir = Path(path) / ckpt.path if kind == "run" else location
        entry: dict[str, Any] = {"step": ckpt.step, "valid": ckpt.valid}
        if ckpt.manifest_checksum is not None:
            identity = gate_records.checkpoint_identity(run_dir, ckpt_dir)
            if identity["manifest_checksum"] != ckpt.manifest_checksum:
                # Never record one checkpoint's verdict under another's digest.
                raise cf.CheckpointError(f"{ckpt_dir} changed while it was validated")
            entry.update(identity)
            entry["valid"] = ckpt.valid
        # What was checked and what was not: promotion requires full_check.
        entry.update(checks=list(ckpt.checks), skipped=list(ckpt.skipped), full_check=ckpt.full_check)
        checkpoints[os.path.relpath(os.path.abspath(ckpt_dir), os.path.abspath(run_dir))] = entry  # as named
    return gate_records.write_record(run_dir, gate_records.VALIDATION, {
        "passed": report.valid,
        "full_check": report.valid and all(c.full_check for c in report.checkpoints),
        "checkpoints": checkpoints,
        "findings": [str(f) for f in report.all_findings],
    })


def format_validation(report: Any) -> str:
    """The human-readable verdict: one line per checkpoint, its checks, findings and what was ignored."""
    lines = []
    for ckpt in report.checkpoints:
        rate = f", read at {ckpt.bytes / ckpt.read_seconds / 1e9:.2f} GB/s" if ckpt.read_seconds else ""
        verdict = "VALID" if ckpt.valid else "INVALID"
        lines.append(f"{verdict} {ckpt.path} (step {ckpt.step}, {ckpt.world_size} ranks, {ckpt.bytes} bytes"
                     f"{rate}, {ckpt.seconds:.2f} s)")
        lines += [f"  ok  {check}" for check in ckpt.checks]
        lines += [f"  SKIPPED {check}: not proven (promotion needs the full check)" for check in ckpt.skipped]
    for finding in report.all_findings:
        lines.append(f"  FINDING {finding}")
    for item in report.ignored:
        lines.append(f"  ignored {item['path']}: {item['reason']}")
    if not report.checkpoints:
        lines.append(f"INVALID {report.target}: no committed checkpoint validated")
    return "\n".join(lines)
