"""Tool calling on chat: how a request's tools are used, and the readers of calls out of generated
text."""
