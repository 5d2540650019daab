"""The HTTP server: the Starlette app and its routes, guards and error handlers, the HTTP/1.1
protocol with its bounds, accepting on a shared socket for several API servers, the serve
process's life and its stats line.

May import: the gateway floors below it (api, text, metrics, link, replicas, generation, offline),
protocol/.
"""
