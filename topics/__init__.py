"""The wire contract: topic names and configs (`registry`) and one versioned schema per message.

Every message is a frozen `msgspec.Struct` with a `v` (schema version) field, encoded as JSON.
`codec.decode` turns bytes into a typed message or raises `codec.SchemaError`; nothing else parses
payloads.
"""
