"""The command line: parses, calls the library, renders the report. May import anything."""
