"""Output parsers of the chat API, one job per module:

- reasoning.py: `glm45`, GLM's `<think>…</think>` as `reasoning_content`
- tool_calls.py: `glm47`, GLM-4.7/GLM-5 `<tool_call>` markup as OpenAI `tool_calls`
- arguments.py: tool-call argument values typed by the tool's JSON schema
- chat.py: both applied to one chat request's output, whole or streamed

The names are SGLang's (`--reasoning-parser glm45 --tool-call-parser glm47`); the config
(router.reasoning_parser, router.tool_call_parser) accepts exactly these.
"""

REASONING_PARSERS = ("glm45",)
TOOL_CALL_PARSERS = ("glm47",)
