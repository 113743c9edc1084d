"""``python -m resilient_training.runtime.ft_launch ARGS`` (or ``resilient-ft-launcher ARGS``):
NVRx's ``ft_launcher`` with the same arguments, after :func:`nvrx_adapter.quicken_rendezvous`
and :func:`nvrx_adapter.quicken_teardown`.

A wrapper, not a fork: the launcher is NVRx's own module, run as ``__main__`` in this process
(it imports the replaced function by name then), so the two changes apply to it: how often a
waiting agent polls the rendezvous store, and a worker teardown that ends once the workers are
gone instead of after a fixed second.
"""

from __future__ import annotations

import runpy
import sys

from resilient_training.runtime import nvrx_adapter

LAUNCHER = "nvidia_resiliency_ext.fault_tolerance.launcher"


def main() -> None:
    nvrx_adapter.quicken_rendezvous()
    nvrx_adapter.quicken_teardown()
    sys.argv[0] = "ft_launcher"
    runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
