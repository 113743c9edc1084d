"""Kubernetes naming rules, checked before any API call so a bad name fails with its reason.

The rules are apimachinery's (``k8s.io/apimachinery/pkg/util/validation``): DNS-1123 labels
for namespaces and most names, DNS-1123 subdomains for PV/PVC names, DNS-1035 labels for
PyTorchJob names (the operator's webhook; service names derive from them), label keys/values.
"""

from __future__ import annotations

import hashlib
import posixpath
import re

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def check_dns1123_label(value: str, what: str) -> None:
    if not value or len(value) > 63 or not _DNS1123_LABEL.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not a DNS-1123 label: at most 63 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit"
        )


def check_dns1123_subdomain(value: str, what: str) -> None:
    if not value or len(value) > 253 or not all(_DNS1123_LABEL.fullmatch(p) for p in value.split(".")):
        raise ValueError(
            f"{what} {value!r} is not a DNS-1123 subdomain: at most 253 lowercase letters, digits, '-' or '.', "
            "each dot-separated part starting and ending with a letter or digit"
        )


def check_dns1035_label(value: str, what: str) -> None:
    if not value or len(value) > 63 or not _DNS1035_LABEL.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not a DNS-1035 label: at most 63 lowercase letters, digits or '-', "
            "starting with a letter and ending with a letter or digit"
        )


def check_label_value(value: str, what: str) -> None:
    if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a valid label value (<= 63 of [A-Za-z0-9-_.], alphanumeric ends)")


def check_label_key(key: str, what: str) -> None:
    prefix, _, name = key.rpartition("/")
    if prefix:
        check_dns1123_subdomain(prefix, f"{what} prefix")
    if not name or len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        raise ValueError(f"{what} {key!r} is not a valid label key ([prefix/]name, name <= 63 of [A-Za-z0-9-_.])")


# Mounting a volume on (or over, or inside) these would hide what the pod itself needs there:
# the pod's own /dev/shm volume, the container's system directories and its service-account token.
# /lib64, /sbin and the rest are links into /usr on the trainer's Ubuntu base, which the runtime
# follows: an emptyDir at /lib64 hid the dynamic loader, and no program could start (a stranger
# trial); /run is where /var/run points.
RESERVED_MOUNTS = ("/dev/shm", "/dev", "/proc", "/sys", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                   "/libx32", "/run", "/var/run")
# The image's own trees: a volume at one of them (not inside: /opt/data hides nothing) hides what the
# image installed there (the CUDA image's /opt libraries, the user's home and its packages).
IMAGE_DIRS = ("/opt", "/home", "/root")


def check_absolute_path(path: str, what: str) -> str:
    """``path`` without a trailing slash, refused unless absolute and already normal ('..' could escape a mount).

    No ``$``: Kubernetes expands ``$(VAR)`` (and ``$$``) in a container's args and env but never in
    a volume's ``mountPath``, so the trainer would write elsewhere than the volume is (a stranger trial).

    ``normpath`` keeps a leading ``//`` (POSIX lets it mean something else): refused by name, as the
    message says (``//mnt/run/x`` passed, and a prefix test then took it for outside ``/mnt/run``).
    Whitespace at either end too: ``/scratch/x `` would be made as written, a directory ending in a space.
    """
    stripped = path.rstrip("/") or "/"
    if (not path.startswith("/") or path.startswith("//") or path != path.strip()
            or posixpath.normpath(stripped) != stripped or any(ord(ch) < 32 for ch in path)):
        raise ValueError(f"{what} {path!r} must be an absolute directory without '.', '..', '//', control "
                         "characters or whitespace at either end")
    if "$" in path:
        raise ValueError(f"{what} {path!r} contains '$': Kubernetes expands $(VAR) in the pods' arguments but not "
                         "in a volume's mount path, so the two would differ; give the path itself")
    return stripped


def under_image_dir(path: str) -> str | None:
    """The :data:`IMAGE_DIRS` entry a volume at ``path`` would hide (``path`` is it, or above it)."""
    return next((d for d in IMAGE_DIRS if path == d or path == "/"), None)


def check_mount_path(path: str, what: str) -> str:
    """Where a volume may be mounted in a pod: a normal absolute path clear of :data:`RESERVED_MOUNTS`."""
    mount = check_absolute_path(path, what)
    for reserved in RESERVED_MOUNTS:
        if mount == "/" or mount == reserved or reserved.startswith(mount + "/") or mount.startswith(reserved + "/"):
            raise ValueError(f"{what} {mount!r} collides with {reserved} (mount the claim elsewhere, e.g. /mnt/run)")
    if hidden := under_image_dir(mount):
        raise ValueError(f"{what} {mount!r} would hide the image's {hidden} (mount the claim elsewhere, e.g. /mnt/run)")
    return mount


def name_for_run(prefix: str, run_id: str, *, max_len: int = 40) -> str:
    """A deterministic DNS-1035 name for ``run_id``: the same run always gets the same name.

    The readable part is the run id's leading characters; a hash of the whole id keeps two
    runs whose ids share a prefix apart.
    """
    if not run_id:
        raise ValueError("run_id must not be empty: object names are derived from it")
    check_dns1035_label(prefix, "name prefix")
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")
    room = max_len - len(prefix) - len(digest) - 2
    slug = slug[: max(room, 0)].strip("-")
    name = f"{prefix}-{slug}-{digest}" if slug else f"{prefix}-{digest}"
    check_dns1035_label(name, "derived name")
    return name
