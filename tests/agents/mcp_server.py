"""A real MCP server over stdio, made with the mcp package's own server API (``MCPServer``, mcp 2's
name for FastMCP), for the traced-tool tests: ``add(a, b)`` returns the sum; ``fail(reason)``
raises ``ToolError``, which the server returns as a ``CallToolResult`` with ``isError`` set.

Run as ``python tests/agents/mcp_server.py`` (the client starts it with ``stdio_client``).
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("rlpulse-test-tools")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def fail(reason: str = "asked to") -> str:
    """Always fails, as a tool reports a failure to the model."""
    raise ToolError(f"fail failed: {reason}")


if __name__ == "__main__":
    app.run("stdio")
