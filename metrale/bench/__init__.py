"""`metrale bench`: a serving benchmark against any OpenAI-compatible server, and an offline throughput one.

One module per concept: datasets.py (the requests to send), arrivals.py (when to send them), driver.py (one
streamed request, timed), metrics.py (the figures, as vLLM's bench defines them), result.py (the printed table
and the result JSON, with vLLM's keys), serve.py and throughput.py (the two commands).
"""
