"""Multi-turn, tool-using episodes: environments, the generator's OpenAI-compatible endpoint, trajectories.

A user environment is a class with ``rollout(ctx)`` (:mod:`bucketrl.envs.protocol`); :class:`ToolEnv` runs the
usual chat-with-tools loop. Importing this package needs neither torch nor FastAPI.
"""

from bucketrl.envs.protocol import EXTERNAL, Environment, EpisodeContext, Row
from bucketrl.envs.tools import ToolEnv, tool_schema

__all__ = ["EXTERNAL", "Environment", "EpisodeContext", "Row", "ToolEnv", "tool_schema"]
