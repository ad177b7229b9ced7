"""The environment variables through which a budgeted launch talks to its processes: set by
mucudnn (:mod:`mucudnn.launch`, :mod:`mucudnn.budget`), read by the site hook
(``mucudnn_torch_budget.py``, beside this file) in the program's own interpreter.

Standard library only, and nothing but constants: the hook imports this file at interpreter
start-up as a top-level module (this directory is first on PYTHONPATH), where mucudnn need not be
installed; mucudnn imports it as ``mucudnn._torch_site.mucudnn_torch_env``.
"""

ENV_BUDGET = "MUCUDNN_MEMORY_BUDGET"  # also read by the shim (shim/src/options.c)
ENV_REPORT = "MUCUDNN_BUDGET_REPORT"  # the launcher's file: one line per event of each process
ENV_LOG_LEVEL = "MUCUDNN_LOG_LEVEL"   # the shim's level: info shows what was limited
ENV_OFFLOAD = "MUCUDNN_OFFLOAD"       # 1: mucudnn.torch keeps/offloads/recomputes saved tensors
ENV_OFFLOAD_PROFILE = "MUCUDNN_OFFLOAD_PROFILE"  # a file: the recorded profile and plan, as JSON
ENV_OFFLOAD_HEADROOM = "MUCUDNN_OFFLOAD_HEADROOM"  # percent of the budget plans leave unplanned
ENV_OFFLOAD_FREEZE_GC = "MUCUDNN_OFFLOAD_FREEZE_GC"  # 0: the process-wide session leaves gc alone
ENV_OFFLOAD_LEND = "MUCUDNN_OFFLOAD_LEND"  # 1: workspace lent to the shim where the plan leaves room
ENV_OFFLOAD_RESCUE = "MUCUDNN_OFFLOAD_RESCUE"  # 0: no op refused is run again; always: every step
ENV_OFFLOAD_STAND_ASIDE = "MUCUDNN_OFFLOAD_STAND_ASIDE"  # 0: the session never removes its hooks
ENV_OFFLOAD_REPLAY = "MUCUDNN_OFFLOAD_REPLAY"  # 0: planned steps always record their recipes' calls
ENV_PINNED_REGISTER = "MUCUDNN_PINNED_REGISTER"  # 1: pinned host memory page-locked on threads
#: the largest MUCUDNN_OFFLOAD_HEADROOM: a plan for less than half the budget is no plan for it
MAX_OFFLOAD_HEADROOM = 50
