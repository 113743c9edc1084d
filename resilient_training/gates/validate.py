"""Integrity validation of committed checkpoints: re-read every byte, prove it loads.

:func:`validate` takes a run directory (validates what ``checkpoints/latest`` names, or every
committed checkpoint) or one ``step_N`` directory, and returns a :class:`ValidationReport` with
one :class:`Finding` per problem, each naming the file (and tensor) and what is wrong.
Temporary directories of saves in flight or killed mid-write are listed as ignored: the
commit protocol guarantees nothing loads them, so they are not corruption.

The stages, in order (a stage only looks at files the previous ones found whole):

1. layout: ``latest`` names a committed ``step_N``; the manifest parses and lists every rank;
   each listed file is present and no unknown file sits beside them;
2. bytes: every file is read once in large blocks, in parallel threads (xxhash releases the
   GIL), and its size and xxh3_128 checksum compared with the manifest;
3. contents: each shard loads with ``weights_only=True``; its recorded step, rank, world
   size, optimizer step and data position agree with the manifest; its tensors match the
   manifest's names, shapes, dtypes, layout and per-tensor checksums; floating tensors are
   finite; optimizer state pairs with the model parameters (``exp_avg_sq`` >= 0);
4. load: the slices assemble into global tensors (which is what resharding to another world
   size needs), load strictly into a freshly built model, and every loaded tensor, sliced
   again for the saved and for other world sizes, hashes the same as the saved one.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from resilient_training.run import checkpoint_format as cf
from resilient_training.run import layout

READ_BLOCK = 16 << 20
SUPPORTED_FORMATS = (1,)
MANIFEST_KEYS = ("format_version", "step", "world_size", "files", "tensors")
SHARD_META_KEYS = ("format_version", "step", "rank", "world_size", "layout")


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


def _read_and_hash(path: Path) -> tuple[int, str, float]:
    """(bytes, xxh3_128 hex, seconds) of one file.

    Hashes a read-only memory map in 16 MiB views: no copy out of the page cache, so hashing
    runs faster than a plain read() of the same file (measured: benchmarks/). Empty files
    and files that cannot be mapped fall back to large reads into a reused buffer.
    """
    hasher = cf.new_hasher()
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        try:
            # MAP_POPULATE: the kernel faults the whole file in up front with large reads
            # (page faults one by one read ahead too little when the file is not cached).
            mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                               prot=mmap.PROT_READ) if size else None
        except (OSError, ValueError):
            mapped = None
        if mapped is not None:
            with mapped:
                view = memoryview(mapped)
                try:
                    for offset in range(0, size, READ_BLOCK):
                        hasher.update(view[offset:offset + READ_BLOCK])
                finally:
                    view.release()
            return size, hasher.hexdigest(), time.perf_counter() - start
        buffer = bytearray(READ_BLOCK)
        block = memoryview(buffer)
        size = 0
        while n := handle.readinto(buffer):
            hasher.update(block[:n])
            size += n
    return size, hasher.hexdigest(), time.perf_counter() - start


def hash_files(paths: list[Path], threads: int | None = None) -> dict[Path, tuple[int, str, float] | OSError]:
    """Checksum files in parallel threads; an unreadable file maps to its OSError."""
    workers = max(1, min(len(paths), threads or os.cpu_count() or 1))

    def one(path: Path) -> tuple[int, str, float] | OSError:
        try:
            return _read_and_hash(path)
        except OSError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(paths, pool.map(one, paths), strict=True))


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


class _Checker:
    def __init__(self, ckpt_dir: Path, base: Path, result: CheckpointResult, *, load: bool, threads: int | None):
        self.dir = ckpt_dir
        self.base = base
        self.result = result
        self.load = load
        self.threads = threads
        self.manifest: dict[str, Any] = {}
        self.shards: dict[int, dict[str, Any]] = {}
        self.inconsistent: set[str] = set()  # manifest keys already reported as from another step
        self.expected_ranks: list[int] = []

    def where(self, name: str) -> str:
        return _rel(self.dir / name, self.base)

    def find(self, code: str, name: str, message: str, tensor: str | None = None) -> None:
        self.result.findings.append(Finding(code, self.where(name), message, tensor))

    def run(self) -> None:
        if not self.check_manifest():
            return
        whole = self.check_files()
        self.check_bytes(whole)
        self.check_shards(whole)
        complete = len(self.shards) == self.manifest["world_size"]
        self.check_cross_shard()
        if self.load and complete and not self.result.findings:
            self.check_load()
        elif not self.load:
            self.result.skipped.append("load into a freshly built model (--no-load)")

    # 1. layout ---------------------------------------------------------------------------
    def check_manifest(self) -> bool:
        name = cf.MANIFEST_NAME
        path = self.dir / name
        if not path.is_file():
            self.find("manifest_missing", name, "no manifest: the checkpoint was never committed")
            return False
        try:
            import json

            manifest = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self.find("manifest_invalid", name, f"not valid JSON: {exc}")
            return False
        if not isinstance(manifest, dict):
            self.find("manifest_invalid", name, f"holds a {type(manifest).__name__}, not an object")
            return False
        missing = [k for k in MANIFEST_KEYS if k not in manifest]
        if missing:
            self.find("manifest_incomplete", name, f"lacks {', '.join(missing)}")
            return False
        if manifest["format_version"] not in SUPPORTED_FORMATS:
            self.find("format_unsupported", name, f"format_version {manifest['format_version']!r} is not one of "
                      f"{SUPPORTED_FORMATS}")
            return False
        if not isinstance(manifest["world_size"], int) or manifest["world_size"] < 1:
            self.find("manifest_incomplete", name, f"world_size {manifest['world_size']!r} is not a positive integer")
            return False
        # The trainer steps the optimizer and the data loader once per step: a checkpoint of
        # step N holds optimizer step N and data position N, or its parts are from different steps.
        for key, code in (("optimizer_step", "optimizer_step_mismatch"), ("data_position", "data_position_mismatch")):
            if key in manifest and manifest[key] != manifest["step"]:
                self.inconsistent.add(key)
                self.find(code, name, f"{key} {manifest[key]!r} but step {manifest['step']}: model, optimizer and "
                          "data state are from different steps")
        dir_step = cf.parse_step_dirname(self.dir.name)
        if dir_step is not None and dir_step != manifest["step"]:
            self.find("step_mismatch", name, f"manifest step {manifest['step']} but the directory is {self.dir.name}")
        from resilient_training.run.gate_records import manifest_digest

        self.manifest = manifest
        # A node-local tier checkpoint holds only this node's ranks (manifest "ranks").
        self.expected_ranks = list(manifest.get("ranks") or range(manifest["world_size"]))
        self.result.step = manifest["step"]
        self.result.world_size = manifest["world_size"]
        self.result.manifest_checksum = manifest_digest(self.dir)
        self.result.checks.append("manifest parses and is complete")
        return True

    def check_files(self) -> list[int]:
        """Ranks whose shard is listed and present; findings for missing, misfiled and unknown files."""
        files = self.manifest["files"]
        present: list[int] = []
        for rank in self.expected_ranks:
            name = cf.shard_name(rank)
            entry = files.get(name)
            if entry is None:
                self.find("manifest_incomplete", cf.MANIFEST_NAME, f"does not list rank {rank}'s shard {name}")
                continue
            if entry.get("rank") != rank:
                self.find("rank_mismatch", cf.MANIFEST_NAME, f"lists {name} as rank {entry.get('rank')!r}")
            if not (self.dir / name).is_file():
                self.find("shard_missing", name, f"rank {rank}'s shard is missing")
                continue
            present.append(rank)
        expected = {cf.shard_name(r) for r in self.expected_ranks}
        for name in sorted(set(files) - expected):
            self.find("manifest_incomplete", cf.MANIFEST_NAME,
                      f"lists {name}, which is not a shard of world size {self.manifest['world_size']}")
        for child in sorted(self.dir.iterdir()):
            if child.name not in expected and child.name != cf.MANIFEST_NAME:
                self.find("unexpected_file", child.name, "unknown file inside a committed checkpoint")
        if len(present) == len(self.expected_ranks):
            self.result.checks.append(f"all {len(present)} shards and the manifest present, nothing else")
        return present

    # 2. bytes ----------------------------------------------------------------------------
    def check_bytes(self, ranks: list[int]) -> None:
        paths = [self.dir / cf.shard_name(r) for r in ranks]
        start = time.perf_counter()
        hashed = hash_files(paths, self.threads)
        self.result.read_seconds = time.perf_counter() - start
        whole = []
        for rank, path in zip(ranks, paths, strict=True):
            outcome = hashed[path]
            entry = self.manifest["files"][path.name]
            if isinstance(outcome, OSError):
                self.find("shard_unreadable", path.name, f"cannot be read: {outcome}")
                continue
            size, digest, _ = outcome
            self.result.bytes += size
            if size != entry.get("bytes"):
                self.find("size_mismatch", path.name, f"{size} bytes, manifest records {entry.get('bytes')}")
            elif digest != entry.get("checksum"):
                self.find("checksum_mismatch", path.name,
                          f"{self.manifest.get('checksum_algorithm', cf.CHECKSUM_ALGORITHM)} {digest}, "
                          f"manifest records {entry.get('checksum')}")
            else:
                whole.append(rank)
        ranks[:] = whole
        if len(whole) == len(self.expected_ranks):
            self.result.checks.append(f"sizes and checksums of {self.result.bytes} bytes match the manifest")

    # 3. contents -------------------------------------------------------------------------
    def check_shards(self, ranks: list[int]) -> None:
        for rank in ranks:
            name = cf.shard_name(rank)
            try:
                shard = self._load(self.dir / name)
            except Exception as exc:  # any unpickling failure means the same thing here
                self.find("shard_unreadable", name, f"does not load with weights_only=True: {exc}".strip()[:300])
                continue
            if self._check_meta(name, rank, shard) and self._check_tensors(name, shard):
                self.shards[rank] = shard
        if len(self.shards) == len(self.expected_ranks):
            self.result.checks.append("every shard's step, rank, optimizer step and data position match the manifest")
            self.result.checks.append("every tensor matches the manifest's name, shape, dtype, layout and checksum")
            self.result.checks.append("every floating tensor is finite")

    @staticmethod
    def _load(path: Path) -> dict[str, Any]:
        import torch

        try:
            shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            # Legacy (non-zip) serialisation cannot be memory-mapped.
            shard = torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
        if not isinstance(shard, dict) or not isinstance(shard.get("meta"), dict) or \
                not isinstance(shard.get("tensors"), dict):
            raise cf.CheckpointError("not a {'meta': ..., 'tensors': ...} shard")
        return shard

    def _check_meta(self, name: str, rank: int, shard: dict[str, Any]) -> bool:
        meta = shard["meta"]
        missing = [k for k in SHARD_META_KEYS if k not in meta]
        if missing:
            self.find("shard_meta_invalid", name, f"shard metadata lacks {', '.join(missing)}")
            return False
        ok = True
        if meta["rank"] != rank:
            self.find("rank_mismatch", name, f"shard records rank {meta['rank']} but is rank {rank}'s file")
            ok = False
        if meta["world_size"] != self.manifest["world_size"]:
            self.find("world_size_mismatch", name,
                      f"shard records world size {meta['world_size']}, manifest {self.manifest['world_size']}")
            ok = False
        if meta["step"] != self.manifest["step"]:
            self.find("step_mismatch", name,
                      f"shard records step {meta['step']}, manifest step {self.manifest['step']} "
                      "(a shard from another checkpoint)")
            return False  # its optimizer step and data position then differ too: one problem, one finding
        # Model, optimizer and data-loader state of one step: every rank recorded the optimizer
        # step and data position the manifest holds (the step itself when the manifest has none).
        for key, code in (("optimizer_step", "optimizer_step_mismatch"), ("data_position", "data_position_mismatch")):
            expected = self.manifest.get(key, self.manifest["step"])
            if key not in self.inconsistent and meta.get(key) != expected:
                self.find(code, name, f"shard records {key} {meta.get(key)!r}, expected {expected!r} "
                          f"({'manifest' if key in self.manifest else 'the step'})")
                ok = False
        return ok

    def _check_tensors(self, name: str, shard: dict[str, Any]) -> bool:
        import torch

        from resilient_training.run.checkpoint_format import tensor_checksum

        recorded: dict[str, Any] = self.manifest["tensors"].get(name, {})
        tensors: dict[str, Any] = shard["tensors"]
        layout: dict[str, Any] = shard["meta"]["layout"]
        non_finite: list[tuple[str, str]] = []
        ok = True
        for tname in sorted(set(recorded) - set(tensors)):
            self.find("tensor_missing", name, "listed in the manifest but absent from the shard", tname)
            ok = False
        for tname in sorted(set(tensors) - set(recorded)):
            self.find("tensor_unexpected", name, "in the shard but not listed in the manifest", tname)
            ok = False
        for tname in sorted(set(tensors) & set(recorded)):
            tensor, entry = tensors[tname], recorded[tname]
            if not isinstance(tensor, torch.Tensor):
                self.find("tensor_mismatch", name, f"holds a {type(tensor).__name__}, not a tensor", tname)
                ok = False
                continue
            dtype = str(tensor.dtype).removeprefix("torch.")
            place = layout.get(tname, {})
            problems = []
            if list(tensor.shape) != entry.get("shape"):
                problems.append(f"shape {list(tensor.shape)} != manifest {entry.get('shape')}")
            if dtype != entry.get("dtype"):
                problems.append(f"dtype {dtype} != manifest {entry.get('dtype')}")
            for key in ("global_shape", "offset"):
                if key in entry and place.get(key) != entry[key]:
                    problems.append(f"{key} {place.get(key)} != manifest {entry[key]}")
            if problems:
                self.find("tensor_mismatch", name, "; ".join(problems), tname)
                ok = False
                continue
            if "checksum" in entry and tensor_checksum(tensor) != entry["checksum"]:
                self.find("tensor_checksum_mismatch", name,
                          "values differ from the ones the trainer saved (per-tensor checksum)", tname)
                ok = False
                continue
            if tensor.is_floating_point() or tensor.is_complex():
                # Fast path: one vectorised sum is finite only if every value is (NaN and inf
                # propagate); count precisely only when it is not (it may just overflow).
                bad = 0 if not tensor.numel() or torch.isfinite(tensor.sum()) else int((~torch.isfinite(tensor)).sum())
                if bad:
                    nans = int(torch.isnan(tensor).sum())
                    non_finite.append((tname, f"{bad} of {tensor.numel()} values are not finite "
                                       f"({nans} NaN, {bad - nans} inf)"))
                    ok = False
                    continue
            if tname.endswith("/exp_avg_sq") and tensor.numel() and float(tensor.min()) < 0:
                self.find("optimizer_state_invalid", name,
                          f"AdamW second moment has negative values (min {float(tensor.min()):.3g})", tname)
                ok = False
        if len(non_finite) == 1:
            self.find("non_finite", name, non_finite[0][1], non_finite[0][0])
        elif non_finite:
            # One problem (the state diverged), one finding: name the first tensors, count the rest.
            listed = ", ".join(t for t, _ in non_finite[:4]) + (", ..." if len(non_finite) > 4 else "")
            self.find("non_finite", name, f"{len(non_finite)} tensors hold non-finite values ({listed}); first: "
                      f"{non_finite[0][1]}", non_finite[0][0])
        return ok

    def check_cross_shard(self) -> None:
        """Every rank holds the same tensor names; optimizer state pairs with model parameters."""
        if not self.shards:
            return
        names = {rank: set(s["tensors"]) for rank, s in self.shards.items()}
        reference = names[min(names)]
        for rank, these in names.items():
            if these != reference:
                diff = sorted(these ^ reference)
                self.find("tensor_missing", cf.shard_name(rank),
                          f"tensor names differ from rank {min(names)}'s ({len(diff)} differ)", diff[0])
        layout = self.shards[min(self.shards)]["meta"]["layout"]
        model = {n.removeprefix("model/") for n in reference if n.startswith("model/")}
        optim: dict[str, set[str]] = {}
        for n in reference:
            if n.startswith("optim/"):
                fqn, _, state = n.removeprefix("optim/").rpartition("/")
                optim.setdefault(fqn, set()).add(state)
        file = cf.shard_name(min(self.shards))
        for fqn in sorted(set(optim) - model):
            self.find("optimizer_state_mismatch", file, "optimizer state for a parameter the model lacks",
                      f"optim/{fqn}")
        opt_step = self.manifest.get("optimizer_step")
        for fqn in sorted(model):
            if fqn in optim:
                if optim[fqn] != {"exp_avg", "exp_avg_sq"}:
                    self.find("optimizer_state_mismatch", file, f"has {sorted(optim[fqn])}, expected exp_avg and "
                              "exp_avg_sq", f"optim/{fqn}")
                for state in optim[fqn]:
                    gshape = layout.get(f"optim/{fqn}/{state}", {}).get("global_shape")
                    if gshape != layout.get(f"model/{fqn}", {}).get("global_shape"):
                        self.find("optimizer_state_mismatch", file,
                                  f"global shape {gshape} differs from the parameter's "
                                  f"{layout.get(f'model/{fqn}', {}).get('global_shape')}", f"optim/{fqn}/{state}")
            elif isinstance(opt_step, int) and opt_step > 0 and optim:
                self.find("optimizer_state_mismatch", file,
                          f"no optimizer state for this parameter after {opt_step} optimizer steps", f"model/{fqn}")

    # 4. load -----------------------------------------------------------------------------
    def check_load(self) -> None:
        from resilient_training.run.checkpoint_format import tensor_checksum

        shards = [self.shards[r] for r in range(self.manifest["world_size"])]
        try:
            full = cf.assemble_full(shards)
        except (cf.CheckpointError, RuntimeError) as exc:
            self.find("layout_invalid", cf.MANIFEST_NAME, f"slices do not assemble into global tensors: {exc}")
            return
        for tname, tensor in full.items():
            if not self._covers(tname, shards, tensor.shape):
                return
        model = self._fresh_model()
        if model is None:
            return
        state = {n.removeprefix("model/"): t for n, t in full.items() if n.startswith("model/")}
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            self.find("load_failed", cf.MANIFEST_NAME, f"does not load into a fresh model: {exc}"[:600])
            return
        self.result.checks.append("loads strictly into a freshly built model")
        loaded = model.state_dict()
        world = self.manifest["world_size"]
        for fqn, tensor in loaded.items():
            name = f"model/{fqn}"
            for rank, (_, piece) in enumerate(cf.split_dim0(tensor, world)):
                file = cf.shard_name(rank)
                saved = self.manifest["tensors"][file][name].get("checksum") or \
                    tensor_checksum(self.shards[rank]["tensors"][name])
                if tensor_checksum(piece) != saved:
                    self.find("load_hash_mismatch", file, "the tensor loaded into the model does not hash the same "
                              "as the saved slice", name)
                    return
        self.result.checks.append(f"every loaded model tensor hashes the same as the saved one ({world} ranks)")
        # Resharding to any world size is slicing these global tensors along dim 0 (split_dim0):
        # the slices tiled dim 0 exactly (_covers) and the whole state loaded at world size 1.
        self.result.checks.append(f"reshardable: {world} rank slices assemble into the global tensors a single "
                                  "process loads")

    def _covers(self, tname: str, shards: list[dict[str, Any]], shape: Any) -> bool:
        """The rank slices tile dim 0 exactly: no gap, no overlap (what resharding relies on)."""
        spans = sorted((s["meta"]["layout"][tname]["offset"], s["tensors"][tname].shape[0] if s["tensors"][tname].dim()
                        else 1, r) for r, s in enumerate(shards))
        expected = 0
        for offset, length, rank in spans:
            if length == 0:
                continue
            if offset != expected:
                self.find("layout_invalid", cf.shard_name(rank),
                          f"slice starts at row {offset}, expected {expected} (gap or overlap)", tname)
                return False
            expected += length
        total = shape[0] if len(shape) else 1
        if expected != total:
            self.find("layout_invalid", cf.MANIFEST_NAME, f"slices cover {expected} of {total} rows", tname)
            return False
        return True

    def _fresh_model(self) -> Any:
        from resilient_training.run.config import ModelConfig
        from resilient_training.runtime.model import build_model

        cfg = self.manifest.get("model_config")
        if not isinstance(cfg, dict):
            self.find("manifest_incomplete", cf.MANIFEST_NAME, "lacks model_config: cannot build a model to load into")
            return None
        try:
            return build_model(ModelConfig(**cfg), int(self.manifest.get("seed", 0)))
        except (TypeError, ValueError) as exc:
            self.find("manifest_incomplete", cf.MANIFEST_NAME, f"model_config {cfg} builds no model: {exc}")
            return None


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
            entry.update(gate_records.checkpoint_identity(run_dir, ckpt_dir))
            entry["valid"] = ckpt.valid
        # What was checked and what was not: promotion requires full_check.
        entry.update(checks=list(ckpt.checks), skipped=list(ckpt.skipped), full_check=ckpt.full_check)
        checkpoints[os.path.relpath(ckpt_dir.resolve(), run_dir.resolve())] = entry
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
