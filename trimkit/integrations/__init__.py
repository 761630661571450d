"""trimkit inside the RAG frameworks people already use.

Each integration is its own module and imports its framework only when you import it, so
``import trimkit`` never needs a framework installed:

- :mod:`trimkit.integrations.langchain` (extra ``trimkit[langchain]``, on ``langchain-core``):
  ``TrimmedChatModel(inner, ttft_budget_s=...)``, a chat model that plans every request of a
  ``ChatLlamaCpp`` or a ``ChatOpenAI`` pointed at a local server through trimkit and attaches the
  report (``response_metadata["trimkit"]``); ``trimkit_trimmer(...)``, an LCEL step that trims a
  prompt's messages for any model after it; ``trimkit_context()``, the formatter of retrieved
  documents that lets both find them inside the prompt.
- :mod:`trimkit.integrations.llamaindex` (extra ``trimkit[llamaindex]``, on ``llama-index-core``):
  a node postprocessor and a wrapper for a LlamaIndex LLM (see that module).

One module per framework holds all of that framework's integration (its wrapper, its conversions,
the engine behind its model); ``_openai_errors`` (no framework) is what both share: trimkit's
server errors as the ``openai`` errors the frameworks' OpenAI clients raise.

How to use them, what is trimmed where and how to read the report from inside each framework:
``docs/integrations.md``. The planner, the guarantees and the report are trimkit's own
(``docs/design.md``): an integration converts the framework's messages and documents, and sends
them through :func:`trimkit.wrap` on the engine the framework's model already talks to.
"""
