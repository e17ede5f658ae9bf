"""ZenFlow reference implementation: importance-aware, bounded-asynchronous offloaded AdamW (torch only).

`import zenflow` imports torch and the standard library, nothing else (`pip install .` installs only torch).
`zenflow.harness`, `zenflow.telemetry` and `zenflow.bench_compare` need the `[harness]` extra and are never imported
from here (tests/project/test_library_only_torch.py).
"""

from zenflow.config import ConfigError, ZenFlowConfig, load_deepspeed_config
from zenflow.optimizer import ZenFlowAdamW
from zenflow.worker import HostWorkerError

__all__ = ["ConfigError", "HostWorkerError", "ZenFlowAdamW", "ZenFlowConfig", "load_deepspeed_config"]
__version__ = "0.1.0"
