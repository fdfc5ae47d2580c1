"""MoE routing tools: Routing Replay (R2/R3) cache, the expert-flip tracker and the set-wise flip rate.

Imports only torch; talks to the model through duck typing (a capture with `.stacked()` / `.live_stacked()`,
a replay source with `.indices(layer)`), see moe_gspo/model/routing_capture.py and docs/routing.md.
"""

from moe_gspo.routing.cache import MODES, ReplaySource, RoutingReplayCache
from moe_gspo.routing.flips import flip_rate, slots_not_in
from moe_gspo.routing.tracker import ExpertFlipTracker

__all__ = ["MODES", "ExpertFlipTracker", "ReplaySource", "RoutingReplayCache", "flip_rate", "slots_not_in"]
