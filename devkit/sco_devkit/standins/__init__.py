"""Protocol-level stand-ins for services that cannot run on the project's machines.

Each says plainly that it is a stand-in and which version of the real API it follows; tests check them
against the official clients. Nothing in the product imports this package.
"""
