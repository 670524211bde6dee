# Runs before main.py on every boot. Deliberately empty of anything that can fail: an error here
# would stop the device before main.py could print a useful message.
