"""`rredcot explain`: where a method's credit went, as pictures and scores."""
