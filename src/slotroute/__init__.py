"""slotroute: exact routed-experts capture and slot-indexed storage for MoE serving.

The core (this namespace) needs only numpy and msgspec. ``slotroute.capture`` needs
torch; ``slotroute.vllm`` is the vLLM plugin.
"""

from slotroute.spec import MissingRoutingError, RoutingSpec, split_routed_experts
from slotroute.store import RoutedExpertsManager
from slotroute.wire import RoutedExpertsLists

__all__ = [
    "MissingRoutingError",
    "RoutedExpertsLists",
    "RoutedExpertsManager",
    "RoutingSpec",
    "split_routed_experts",
]
__version__ = "0.1.0"
