//! Grammar masks computed beside the forward step (`Constraint::prepare`) are the masks computed
//! in line: also when a token is taken before the prepared mask is read, and along drafts, taken
//! or not.

use std::path::Path;

use charm_coordinator::decode::grammar::{close_objects, GrammarSpec, Grammars};
use charm_coordinator::decode::tokenizer::TextTokenizer;
use charm_shared::config::ModelSpec;
use serde_json::json;

#[test]
fn prepared_masks_equal_masks_computed_in_line() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/charm-bard-moe");
    let tok = TextTokenizer::load(&demo).unwrap();
    let spec = ModelSpec::from_dir(&demo).unwrap();
    let (vocab, eos) = (spec.vocab_size, spec.eos_token_ids[0]);
    let g = Grammars::new(&tok, vocab, &spec.eos_token_ids).unwrap();
    let grammar = GrammarSpec::JsonSchema {
        schema: json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "act": {"type": "integer", "minimum": 1, "maximum": 5},
            "mood": {"enum": ["comic", "tragic"]}},
            "required": ["name", "act", "mood"], "additionalProperties": false}),
        strict: true,
    };
    let answer = tok
        .encode(r#"{"name": "Romeo", "act": 2, "mood": "tragic"}"#)
        .unwrap();
    let mask = |c: &mut charm_coordinator::decode::grammar::Constraint| {
        let mut l = vec![0.0f32; vocab];
        c.apply(&mut l).unwrap();
        l.iter().map(|x| x.is_finite()).collect::<Vec<bool>>()
    };
    // in line; prepared; prepared every other token and read at the others; prepared along the
    // answer's next tokens; prepared along tokens the answer does not take
    let mut cs: Vec<_> = (0..5).map(|_| g.constraint(&grammar).unwrap()).collect();
    let [inline, prepared, skipping, drafted, misdrafted] = &mut cs[..] else {
        unreachable!("five constraints")
    };
    for (i, &t) in answer.iter().enumerate() {
        let want = mask(inline);
        assert!(want[t as usize], "token {i} of the answer is allowed");
        assert!(
            want.iter().filter(|&&a| a).count() < vocab,
            "token {i}: a mask"
        );
        prepared.prepare(&[]);
        assert_eq!(mask(prepared), want, "token {i}, prepared");
        if i % 2 == 0 {
            // a mask prepared and never read is dropped when the token is taken
            skipping.prepare(&[]);
        } else {
            assert_eq!(mask(skipping), want, "token {i}, read every other token");
        }
        // drafts: the three tokens the answer takes from here (all taken; a prepare while masks
        // for them are left is a no-op), or three tokens it does not take
        let ahead = &answer[i..(i + 3).min(answer.len())];
        drafted.prepare(ahead);
        assert_eq!(mask(drafted), want, "token {i}, drafted");
        let wrong: Vec<u32> = ahead.iter().map(|&d| (d + 1) % vocab as u32).collect();
        misdrafted.prepare(&wrong);
        assert_eq!(mask(misdrafted), want, "token {i}, other drafts");
        for c in [&mut *inline, prepared, skipping, drafted, misdrafted] {
            c.accept(t).unwrap();
        }
    }
    for c in &mut cs {
        // the answer is complete: only the end of the sequence is left
        c.prepare(&[eos]);
        let m = mask(c);
        assert!(m[eos as usize] && m.iter().filter(|&&a| a).count() == 1);
    }
}

#[test]
fn objects_that_leave_additional_properties_unset_are_closed() {
    let mut s = json!({"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "open": {"type": "object", "additionalProperties": true},
        "list": {"type": "array", "items": {"properties": {"c": {}}}},
        "either": {"anyOf": [{"type": ["object", "null"]}, {"type": "string"}]},
        "merged": {"allOf": [{"properties": {"d": {}}}, {"properties": {"e": {"type": "object"}}}]},
        "ref": {"$ref": "#/$defs/X"}},
        "$defs": {"X": {"type": "object", "unevaluatedProperties": true, "properties": {"y": {"type": "object"}}}}});
    close_objects(&mut s);
    let closed = |v: &serde_json::Value| v["additionalProperties"] == json!(false);
    let p = &s["properties"];
    assert!(closed(&s) && closed(&p["a"]), "{s}");
    assert_eq!(p["open"]["additionalProperties"], json!(true));
    assert!(closed(&p["list"]["items"]));
    assert!(closed(&p["either"]["anyOf"][0]));
    assert!(p["either"]["anyOf"][1]
        .get("additionalProperties")
        .is_none());
    // allOf's parts are merged: each is left open, what is inside them is closed
    assert!(p["merged"].get("additionalProperties").is_none());
    assert!(p["merged"]["allOf"][0]
        .get("additionalProperties")
        .is_none());
    assert!(closed(&p["merged"]["allOf"][1]["properties"]["e"]));
    assert!(p["ref"].get("additionalProperties").is_none());
    let x = &s["$defs"]["X"];
    assert!(x.get("additionalProperties").is_none() && closed(&x["properties"]["y"]));
}
