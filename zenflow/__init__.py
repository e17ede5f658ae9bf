"""ZenFlow reference implementation: importance-aware, bounded-asynchronous offloaded AdamW (torch only)."""

from zenflow.config import ConfigError, ZenFlowConfig, load_deepspeed_config
from zenflow.host import HostWorkerError
from zenflow.optimizer import ZenFlowAdamW

__all__ = ["ConfigError", "HostWorkerError", "ZenFlowAdamW", "ZenFlowConfig", "load_deepspeed_config"]
__version__ = "0.1.0"
