"""Edges of the service: configuration, HTTP API, Serve app, CLI, batch job and benchmark."""
