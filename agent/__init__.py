"""Hypotheses: the CLI, the agent graph, the LLM client, the git workspace, policies and summaries."""
