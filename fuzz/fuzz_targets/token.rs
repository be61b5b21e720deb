//! The enrolment token parser, on what a person pastes. The first byte chooses the input: even,
//! the rest is the pasted text; odd, the rest is a token's payload, completed with its checksum
//! so that the fuzzer reaches the fields behind it (a four-byte SHA-256 prefix it cannot guess).
//!
//! A token that parses is canonical: it encodes to exactly the text it was read from (without
//! the whitespace around it), so no two texts name one token.
#![no_main]

use libfuzzer_sys::fuzz_target;
use trellis_core::token::EnrolmentToken;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let text = if mode % 2 == 0 { String::from_utf8_lossy(rest).into_owned() } else { trellis_fuzz::token_text(rest) };
    let Ok(token) = EnrolmentToken::decode(&text) else { return };
    let again = token.encode().unwrap_or_else(|e| panic!("{token:?} was read from {text:?} but does not encode: {e}"));
    assert_eq!(again, text.trim(), "{token:?} is written differently from the text it was read from");
    assert_eq!(EnrolmentToken::decode(&again).as_ref(), Ok(&token));
});
