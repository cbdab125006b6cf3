"""posttrain-env-tools: tool-calling episodes.

Tools are plain Python functions with a JSON schema (:mod:`.tool`); the model's calls are
parsed from its text in one of two formats (core's :mod:`posttrain.data.tool_calls`), run in worker processes with a
deadline (:mod:`.invoke`), and answered with ``tool`` messages; the episode's final answer is
scored by another environment (:mod:`.environment`).
"""
