"""OpenAI's Responses API (`POST /v1/responses`): its request body and its reply."""
