"""External MCP servers the chat uses beside device tools (docs/mcp-servers.md).

Nothing is imported here so that backend/config.py can import `backend.mcp_servers.settings`
without a cycle; import from the submodules (`hub`, `settings`, `connectors`, `toolbox`, `api`).
"""
