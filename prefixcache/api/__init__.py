"""The engine boundary: what the server and the offline API program against (EngineAPI,
EngineRequest, typed results), the request's plain data and the typed errors. No torch."""
