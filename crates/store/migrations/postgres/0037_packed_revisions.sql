-- A revision's files packed (LZ4 of the JSON `files` held before, its length first): at 100,000
-- nodes a declaration is 12.8 MiB of text, written at every apply; packed it is about 2.7 MiB.
-- Rows from before keep their `files`; a packed row has `files` empty. Stored out of line
-- without PostgreSQL's own compression (it is compressed already).
ALTER TABLE revisions ADD COLUMN packed BYTEA;
ALTER TABLE revisions ALTER COLUMN packed SET STORAGE EXTERNAL;
