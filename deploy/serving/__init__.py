"""Serving: the Ray Serve app, the OpenAI API and its schemas, prompt encoding."""
