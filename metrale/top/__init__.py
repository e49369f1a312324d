"""`metrale top`: a live terminal view of a running server (snapshot.py gathers, view.py draws, cli.py loops)."""
