"""The xiaozhi-style MCP endpoint: MCP servers dial in over a WebSocket (docs/mcp-servers.md).

`endpoint.DialInEndpoint` is the route and the registry of live dial-ins; `pipe` adapts an accepted
WebSocket to the streams of an `mcp.ClientSession`.
"""
