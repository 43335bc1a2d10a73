"""The chat layer: what the app, the server and `mtpchat run` share above the engine.

prompt.py renders a conversation into prompt ids; think.py splits a reply into thinking and answer;
stops.py cuts it at a stop string; reply.py drives one generation into text; engine.py declares the
engine these take (the local one, a server's, the fake one). Nothing here imports torch or textual.
"""
