"""Adapters that connect pycompactor to agent frameworks (each needs its own extra).

* `pycompactor.integrations.openai_agents`: a Session for the OpenAI Agents SDK
  (the `agents` extra: `pip install 'openai-agents>=0.6'`).
"""
