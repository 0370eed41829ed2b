"""The generation lifecycle every API dialect shares: prompt preparation, the request scope,
streaming with heartbeats, output assembly, tools and structured output."""
