"""MoE routing tools: Routing Replay (R2/R3) cache, the expert-flip tracker, the set-wise flip rate and the old
policy's router scores (RSPO).

Imports only torch; talks to the model through duck typing (a capture with `.stacked()` / `.live_stacked()`,
a replay source with `.indices(layer)`), see moe_gspo/model/routing_capture.py and docs/guide/routing.md.
"""

from moe_gspo.model.routing_capture import ReplaySource
from moe_gspo.routing.cache import MODES, RoutingReplayCache
from moe_gspo.routing.flips import flip_rate, slots_not_in
from moe_gspo.routing.scores import SCORE_DTYPES, OldRouterScores
from moe_gspo.routing.tracker import ExpertFlipTracker

__all__ = ["MODES", "SCORE_DTYPES", "ExpertFlipTracker", "OldRouterScores", "ReplaySource", "RoutingReplayCache",
           "flip_rate", "slots_not_in"]
