"""Tool calling: OpenAI's tools and tool_choice, parsed calls, and reuse across tool turns."""
