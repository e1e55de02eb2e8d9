"""The SFT wing: the cold start on demonstrations, the recorder that writes them and the scripted experts."""
