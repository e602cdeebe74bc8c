//! The shape checks every received message passes before anything uses it: a request against
//! what the worker knows of the model ([`Limits`]), a result against its request.

use super::{ComputeRequest, ComputeResult, Limits, ResultView, WireError};

fn shape(m: String) -> WireError {
    WireError::Shape(m)
}

impl ComputeRequest {
    /// Refuses a request that does not fit `limits`: another width, a partial row, too many
    /// tokens, unknown or unsorted experts, rows out of range or repeated within a run.
    pub fn check(&self, limits: &Limits) -> Result<(), WireError> {
        let h = self.hidden as usize;
        if h != limits.hidden {
            return Err(shape(format!(
                "hidden {h}, the model's is {}",
                limits.hidden
            )));
        }
        let values = self.values();
        if h == 0 || !values.is_multiple_of(h) {
            return Err(shape(format!(
                "{values} activations are not whole rows of {h}"
            )));
        }
        if self.group > 0 {
            let g = self.group as usize;
            if !self.x.is_empty() || !h.is_multiple_of(g) || self.amax.len() != values / g {
                return Err(shape(format!(
                    "{} codes in groups of {g} with {} scales and {} floats for width {h}",
                    values,
                    self.amax.len(),
                    self.x.len()
                )));
            }
        } else if !self.codes.is_empty() || !self.amax.is_empty() {
            return Err(shape("codes without a group".into()));
        }
        let tokens = values / h;
        if tokens == 0 || tokens > limits.max_tokens {
            return Err(shape(format!(
                "{tokens} tokens (1..={} allowed)",
                limits.max_tokens
            )));
        }
        if !matches!(self.activations.as_str(), "f32" | "int8") {
            return Err(shape(format!(
                "activation mode `{}` (f32 or int8)",
                self.activations
            )));
        }
        if self.runs.is_empty() {
            return Err(shape("no experts to run".into()));
        }
        let mut last = None;
        for r in &self.runs {
            if r.expert as usize >= limits.n_experts {
                return Err(shape(format!(
                    "expert {} of a layer with {}",
                    r.expert, limits.n_experts
                )));
            }
            if last.is_some_and(|l| l >= r.expert) {
                return Err(shape("runs are not in ascending expert order".into()));
            }
            last = Some(r.expert);
            if r.rows.is_empty() || r.rows.len() > tokens {
                return Err(shape(format!(
                    "expert {} runs on {} of {tokens} rows",
                    r.expert,
                    r.rows.len()
                )));
            }
            let mut seen = vec![false; tokens];
            for &row in &r.rows {
                match seen.get_mut(row as usize) {
                    Some(s) if !*s => *s = true,
                    Some(_) => {
                        return Err(shape(format!("row {row} repeated for expert {}", r.expert)))
                    }
                    None => return Err(shape(format!("row {row} of {tokens}"))),
                }
            }
        }
        Ok(())
    }
}

impl ComputeResult {
    /// Refuses a result that does not answer `req`: another id, or not `[rows, hidden]` for
    /// every row of its runs.
    pub fn check(&self, req: &ComputeRequest) -> Result<(), WireError> {
        check_result(self.id, self.out.len(), req)
    }
}

impl ResultView {
    /// [`ComputeResult::check`].
    pub fn check(&self, req: &ComputeRequest) -> Result<(), WireError> {
        check_result(self.id, self.len, req)
    }
}

fn check_result(id: u64, values: usize, req: &ComputeRequest) -> Result<(), WireError> {
    if id != req.id {
        return Err(shape(format!("result {id} for request {}", req.id)));
    }
    let rows: usize = req.runs.iter().map(|r| r.rows.len()).sum();
    if Some(values) != rows.checked_mul(req.hidden as usize) {
        return Err(shape(format!(
            "{values} values for {rows} rows of {} ({} experts)",
            req.hidden,
            req.runs.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::{quantized, request, LIMITS};
    use super::super::{decode, encode, ActCodes, Message, Run, LEN_BYTES};
    use super::*;

    #[test]
    fn requests_that_do_not_fit_the_model_are_refused() {
        let ok = |runs| request(3, 8, runs);
        let run = |expert, rows: &[u32]| Run {
            expert,
            rows: rows.to_vec(),
        };
        for (bad, why) in [
            (ok(vec![run(16, &[0])]), "expert 16"),
            (ok(vec![run(3, &[0]), run(2, &[1])]), "ascending"),
            (ok(vec![run(3, &[0, 0])]), "repeated"),
            (ok(vec![run(3, &[3])]), "row 3 of 3"),
            (ok(vec![run(3, &[])]), "0 of 3"),
            (ok(vec![]), "no experts"),
            (request(3, 4, vec![run(1, &[0])]), "hidden 4"),
            (request(65, 8, vec![run(1, &[0])]), "65 tokens"),
        ] {
            let e = bad.check(&LIMITS).unwrap_err().to_string();
            assert!(e.contains(why), "{e} (wanted {why})");
        }
        let mut partial = ok(vec![run(1, &[0])]);
        partial.x.pop();
        assert!(partial.check(&LIMITS).is_err());
        let mut mode = ok(vec![run(1, &[0])]);
        mode.activations = "f16".into();
        assert!(mode.check(&LIMITS).is_err());
    }

    #[test]
    fn results_must_answer_their_request() {
        let req = request(
            2,
            8,
            vec![Run {
                expert: 1,
                rows: vec![0, 1],
            }],
        );
        let res = |id, out| ComputeResult {
            id,
            compute_ns: 0,
            out,
        };
        assert_eq!(res(7, vec![0.0; 16]).check(&req), Ok(()));
        assert!(res(8, vec![0.0; 16]).check(&req).is_err());
        assert!(res(7, vec![0.0; 15]).check(&req).is_err());
        assert!(res(7, vec![0.0; 24]).check(&req).is_err());
        assert!(res(7, vec![]).check(&req).is_err());
    }

    #[test]
    fn coded_requests_are_checked_and_give_their_activations_back() {
        let x: Vec<f32> = (0..3 * 64).map(|i| (i as f32 * 0.1).sin()).collect();
        let c = ActCodes::encode(&x, 32).unwrap();
        let mut r = request(
            3,
            64,
            vec![Run {
                expert: 1,
                rows: vec![0, 2],
            }],
        );
        r.x.clear();
        (r.group, r.codes, r.amax) = (32, c.codes.clone(), c.amax.clone());
        let limits = Limits {
            hidden: 64,
            ..LIMITS
        };
        assert_eq!(r.check(&limits), Ok(()));
        assert_eq!(r.tokens(), 3);
        assert_eq!(quantized(&r.activations_f32(), 32), quantized(&x, 32));
        let f = encode(&Message::Compute(r.clone())).unwrap();
        assert_eq!(
            decode(&f[LEN_BYTES..]).unwrap(),
            Message::Compute(r.clone())
        );
        let mut bad = r.clone();
        bad.amax.pop();
        assert!(bad.check(&limits).is_err());
        let mut bad = r.clone();
        bad.group = 48;
        assert!(bad.check(&limits).is_err());
        let mut bad = r.clone();
        bad.x = vec![0.0; 64];
        assert!(bad.check(&limits).is_err());
    }
}
